"""Step programs compiled at their first use, or beside the engine, instead of all at start-up.

A demo engine on a CPU plans dozens of programs (buckets x sampler variants) and a short session
runs a few of them: compiling all of them first is most of its start-up. `LazyPrograms` stands in
for the list of one bucket's compiled variants; indexing it compiles that variant once (lowering
included), as a planned compile that the compile guard does not count.

`BackgroundCompile` (compile mode "background") compiles every program the program store did not
hold on threads of its own while the engine already serves: a step that needs a program nobody
has compiled yet compiles it itself, and one that needs a program a thread is compiling waits for
that compile, so each program is compiled exactly once. The engine's own compiles come first:
tracing a program is Python work that holds the GIL, so the background threads trace one at a
time (their XLA compiles, which release it, still run side by side) and start nothing new while
the engine waits for a program; otherwise a step's trace would share the GIL with every compile
thread. On CPUs the compiles of these programs take turns (one lock): XLA:CPU can crash writing
one executable to the persistent cache while another thread compiles (runner/precompile.py).
"""

import atexit
import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import jax

from mrv2_jax.runner.compile_guard import planned

_CPU_COMPILE_LOCK = threading.Lock()
_BACKGROUND_TRACE_LOCK = threading.Lock()  # one background thread traces at a time
_FOREGROUND = threading.Condition()  # guards _foreground_waits
_foreground_waits = 0  # threads other than the background ones waiting for a program
_thread = threading.local()  # .background: True on BackgroundCompile's threads
EXIT_WAIT_S = 120.0  # at exit, how long the compiles still running may take to finish


def _one_compile_at_a_time():
    return _CPU_COMPILE_LOCK if jax.default_backend() == "cpu" else contextlib.nullcontext()


def _in_background() -> bool:
    return getattr(_thread, "background", False)


@contextlib.contextmanager
def _foreground_waiting():
    """While a non-background thread waits for a program, background threads start no new one."""
    global _foreground_waits
    with _FOREGROUND:
        _foreground_waits += 1
    try:
        yield
    finally:
        with _FOREGROUND:
            _foreground_waits -= 1
            _FOREGROUND.notify_all()


def _until_no_foreground_waits() -> None:
    with _FOREGROUND:
        _FOREGROUND.wait_for(lambda: _foreground_waits == 0)


class LazyPrograms(Sequence):
    """One bucket's programs, one per sampler variant: `compile(lower(i))` is variant i, or
    `lower(i)` itself without `compile`. With `store` (a pair of callables `load(i)` -> program or
    None, `compile(i, lowered)` -> the program, compiled and saved), a stored program is used as it
    is, and the store compiles the others in place of `compile`.
    Safe to index from several threads."""

    def __init__(self, lower: Callable[[int], object], count: int, compile: Callable[[object], object] | None = None,
                 store: tuple[Callable[[int], object], Callable[[int, object], object]] | None = None):
        self._lower = lower
        self._compile = compile
        self._store = store if compile is not None else None
        self._programs: list = [None] * count
        self._compiling: dict[int, Future] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._programs)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        program = self._programs[index]
        if program is not None:
            return program
        if _in_background():
            return self.ensure(index)
        with _foreground_waiting():
            return self.ensure(index)

    def _make(self, index: int):
        stored = self._store[0](index) if self._store else None
        if stored is not None:
            return stored
        trace_lock = _BACKGROUND_TRACE_LOCK if _in_background() else contextlib.nullcontext()
        with trace_lock:
            lowered = self._lower(index)
        if self._compile is None:
            return lowered
        return self._store[1](index, lowered) if self._store else self._compile(lowered)

    def ensure(self, index: int):
        """Program `index`, compiled now by this thread unless another one is compiling it (then
        waited for) or has compiled it."""
        with self._lock:
            if self._programs[index] is not None:
                return self._programs[index]
            future = self._compiling.get(index)
            mine = future is None
            if mine:
                future = self._compiling[index] = Future()
        if not mine:
            return future.result()
        try:
            with _one_compile_at_a_time(), planned():
                program = self._make(index)
        except BaseException as exc:
            with self._lock:
                del self._compiling[index]
            future.set_exception(exc)
            raise
        with self._lock:
            self._programs[index] = program
            del self._compiling[index]
        future.set_result(program)
        return program

    def load_stored(self, index: int) -> bool:
        """Variant `index` from the store when it holds it, without compiling anything;
        -> whether the variant is ready now."""
        program = self._store[0](index) if self._store and self._programs[index] is None else None
        with self._lock:
            if program is not None and self._programs[index] is None:
                self._programs[index] = program
            return self._programs[index] is not None

    def ready(self) -> list:
        """The variants compiled (or loaded) so far."""
        return [p for p in self._programs if p is not None]

    @property
    def num_compiled(self) -> int:
        return sum(p is not None for p in self._programs)


class BackgroundCompile:
    """Compiles `(programs, index)` pairs in the given order on `workers` daemon threads; `wait()`
    until all are done, `stop()` to skip the ones not started. When the process exits, the compiles
    not started are skipped and the ones running are waited for: a daemon thread still inside
    XLA when the interpreter finalizes aborts the process ("FATAL: exception not rethrown")."""

    def __init__(self, todo: list[tuple[LazyPrograms, int]], workers: int):
        self._todo = iter(todo)
        self._lock = threading.Lock()
        self._stopped = False
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._work, name=f"mrv2-compile-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    def _work(self) -> None:
        _thread.background = True
        while True:
            _until_no_foreground_waits()
            with self._lock:
                item = None if self._stopped else next(self._todo, None)
            if item is None:
                return
            programs, index = item
            try:
                programs.ensure(index)
            except Exception as exc:  # noqa: BLE001 - the step that needs it compiles it again, and raises there
                self.errors.append(exc)

    def wait(self, timeout: float | None = None) -> bool:
        """True once every thread has finished."""
        for thread in self._threads:
            thread.join(timeout)
        return not any(thread.is_alive() for thread in self._threads)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True

    def close(self, timeout: float = EXIT_WAIT_S) -> None:
        """Skip the compiles not started, wait up to `timeout` s for the running ones."""
        self.stop()
        self.wait(timeout)
        atexit.unregister(self.close)
