"""Structured-output constraints compiled beside the engine loop, so a schema seen for the first
time never stalls the steps of the requests already running (compiling against a large
vocabulary can take seconds). The engine process holds a request back until its constraint is
compiled, then adds it, where the compile cache now answers at once."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

POLL_S = 0.005  # how often an otherwise idle engine loop looks at compiles in flight


class BackgroundCompiles:
    def __init__(self, compiler):
        self._compiler = compiler
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mrv2-constraints") if compiler else None
        self._pending: list[tuple[object, Future]] = []  # (command, its compile), in arrival order

    def needs_compile(self, params) -> bool:
        """Whether a request with these parameters must wait for a compile first."""
        so = params.structured_outputs
        return self._pool is not None and so is not None and self._compiler.cached(so) is None

    def submit(self, cmd) -> None:
        self._pending.append((cmd, self._pool.submit(self._compiler.compile, cmd.params.structured_outputs)))

    def abort(self, request_ids) -> None:
        gone = set(request_ids)
        self._pending = [(cmd, f) for cmd, f in self._pending if cmd.request_id not in gone]

    def done(self) -> list[tuple[object, BaseException | None]]:
        """(command, why its compile failed or None) for every compile that has finished, in
        arrival order."""
        ready = [(cmd, f.exception()) for cmd, f in self._pending if f.done()]
        self._pending = [(cmd, f) for cmd, f in self._pending if not f.done()]
        return ready

    def __bool__(self) -> bool:
        return bool(self._pending)
