"""Counting XLA compilations, so an unplanned compile never goes unnoticed.

Every program the engine runs is planned at start-up (a bucket x sampler variant) and compiled
then, or, with lazy compilation, at its first use inside `planned()`. Any other compile inside an
engine step means a shape or a static argument escaped the buckets, which costs seconds of stall
in serving. The engine checks the process-wide count of unplanned compiles around each step: in
strict mode (tests; `MRV2_STRICT_COMPILES=1`) that is an error, otherwise a counted warning.
"""

import contextlib
import threading
import warnings

import jax

from mrv2_jax import envs

# A real compile, or an executable fetched from the persistent cache instead of compiling:
# either way a new executable appeared.
_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")
_num_compiles = 0
_planned = threading.local()  # per thread: inside planned() (compiles there are not counted)
_by_event = dict.fromkeys(_COMPILE_EVENTS, 0)  # every one, planned or not (start-up reports)
_seconds_by_event = dict.fromkeys(_COMPILE_EVENTS, 0.0)


def _on_event(name: str, duration: float, **_kwargs) -> None:
    global _num_compiles
    if name in _COMPILE_EVENTS:
        _by_event[name] += 1
        _seconds_by_event[name] += duration
        if not getattr(_planned, "active", False):
            _num_compiles += 1


def executables_made() -> tuple[int, int]:
    """(executables compiled, executables loaded from the persistent cache) in this process so
    far, planned ones included."""
    return _by_event[_COMPILE_EVENTS[0]], _by_event[_COMPILE_EVENTS[1]]


def compile_seconds() -> tuple[float, float]:
    """(seconds XLA spent compiling, seconds spent loading executables from the persistent cache)
    in this process so far, on every thread."""
    return _seconds_by_event[_COMPILE_EVENTS[0]], _seconds_by_event[_COMPILE_EVENTS[1]]


@contextlib.contextmanager
def planned():
    """Compiles on this thread inside the block are planned ones (a lazily compiled bucket)."""
    outer = getattr(_planned, "active", False)
    _planned.active = True
    try:
        yield
    finally:
        _planned.active = outer


jax.monitoring.register_event_duration_secs_listener(_on_event)


def num_compiles() -> int:
    """Executables compiled (or loaded from the compilation cache) in this process so far,
    outside `planned()`."""
    return _num_compiles


class CompileGuard:
    def __init__(self, strict: bool | None = None):
        self.strict = envs.read("MRV2_STRICT_COMPILES") if strict is None else strict
        self.num_unexpected = 0

    def report(self, new_compiles: int, where: str) -> None:
        if new_compiles <= 0:
            return
        self.num_unexpected += new_compiles
        message = f"{new_compiles} XLA compilation(s) during {where} after warm-up"
        if self.strict:
            raise RuntimeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
