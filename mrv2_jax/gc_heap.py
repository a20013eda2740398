"""Python's garbage collector around the engine.

What a serving process built at start-up (modules, the model, compiled programs, the tokenizer)
is kept for its whole life: marking it permanent for the collector means a full collection walks
only the objects made since, so the pause it puts between two steps or two streamed chunks no
longer grows with the start-up heap.

A decode step makes a few container objects per row (its schedule, the sampled tokens, the
outputs) that live until the next step or two and are then freed by reference counting. At a few
hundred rows they outnumber generation 0's default threshold (700 net allocations), so a
collection ran nearly every step, a generation-1 one every tenth and now and then a full one;
with a threshold well above one step's live objects the steady state triggers none.
"""

from __future__ import annotations

import contextlib
import gc
import threading

# Generation 0's threshold while an engine runs (net allocations of tracked objects between two
# collections); generations 1 and 2 keep theirs. Above the live objects of a step of a few
# thousand rows (~8 a row), far below what would hold much memory in uncollected cycles.
ENGINE_GEN0_THRESHOLD = 50_000


def _relax() -> tuple[int, int, int]:
    previous = gc.get_threshold()
    if previous[0]:  # (0: automatic collection is off, and stays off)
        gc.set_threshold(max(previous[0], ENGINE_GEN0_THRESHOLD), *previous[1:])
    return previous


_lock = threading.Lock()
_holders = 0  # blocks inside relaxed_collection now, in any thread
_saved: tuple[int, int, int] | None = None  # the thresholds from before the first of them


@contextlib.contextmanager
def relaxed_collection():
    """Generation 0 at ENGINE_GEN0_THRESHOLD inside the block (an engine's run in the caller's
    process: `LLM.generate`, an in-process `AsyncLLM`'s engine thread), the caller's thresholds
    again once the last such block in any thread has ended (the thresholds are the process's)."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            _saved = _relax()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                gc.set_threshold(*_saved)


def prepare_serving_heap() -> int:
    """For a process that serves until it exits: collect once, freeze every object that survived,
    and relax generation 0 for good; -> how many objects are frozen."""
    gc.collect()
    gc.freeze()
    _relax()
    return gc.get_freeze_count()
