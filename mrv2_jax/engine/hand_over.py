"""The engine's record of one step's hand-over to its runner, as the host saw it.

EngineCore fills it around `runner.execute`; with the engine in its own process the step's message
carries its fields to the API processes (engine/core_messages.py), whose metrics histogram them. It
imports nothing heavy, so API processes that never load JAX can use it.
"""

from typing import NamedTuple


class Dispatch(NamedTuple):
    seconds: float  # wall seconds
    prefill_tokens: int  # the step's prompt tokens
    cpu_s: float  # the calling thread's CPU seconds in it: the rest it spent off the CPU, waiting
    call_s: float  # of the seconds, those inside compiled step calls: the rest was the runner's Python
