"""Step programs compiled at their first use, or beside the engine, instead of all at start-up.

A demo engine on a CPU plans dozens of programs (buckets x sampler variants) and a short session
runs a few of them: compiling all of them first is most of its start-up. `LazyPrograms` stands in
for the list of one bucket's compiled variants; indexing it compiles that variant once (lowering
included), as a planned compile that the compile guard does not count.

`BackgroundCompile` (compile mode "background") compiles every program on threads of its own
while the engine already serves: a step that needs a program nobody has compiled yet compiles it
itself, and one that needs a program a thread is compiling waits for that compile, so each
program is compiled exactly once. On CPUs the compiles of these programs take turns (one lock):
XLA:CPU can crash writing one executable to the persistent cache while another thread compiles
(runner/precompile.py).
"""

import atexit
import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import jax

from mrv2_jax.runner.compile_guard import planned

_CPU_COMPILE_LOCK = threading.Lock()
EXIT_WAIT_S = 120.0  # at exit, how long the compiles still running may take to finish


def _one_compile_at_a_time():
    return _CPU_COMPILE_LOCK if jax.default_backend() == "cpu" else contextlib.nullcontext()


class LazyPrograms(Sequence):
    """One bucket's programs, one per sampler variant; `make(i)` lowers and compiles variant i.
    Safe to index from several threads."""

    def __init__(self, make: Callable[[int], object], count: int):
        self._make = make
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
        return program if program is not None else self.ensure(index)

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
        while True:
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
