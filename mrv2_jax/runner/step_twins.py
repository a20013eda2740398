"""Two loaded copies of each step program, called in turn (`--step-twins`, GPUs only).

XLA replays a program's recorded command buffers (CUDA graphs) and records them again, on the host,
when an allocation they use has moved since the program's last call. A step's result is a new buffer
every call, made while the last call's result is still alive (the host reads it after the next call is
made), so it moves every call. With two loaded copies of a program called in turn, each copy's
result can take the place its own last result left, and a call whose input repeats (runner/base.py,
`returning_its_input`) moves nothing. A copy is the program serialized and loaded again, at its first
call: no compile. XLA:CPU cannot serialize the step programs, hence GPUs only.
"""

from __future__ import annotations


def load_twin(compiled):
    """A second loaded executable of `compiled` (its serialized form loaded again)."""
    from jax.experimental import serialize_executable

    return serialize_executable.deserialize_and_load(*serialize_executable.serialize(compiled))


class StepTwins:
    """`pick(program)` -> the program to call now: `program` and its twin by turns, per program."""

    def __init__(self):
        self._pairs: dict[int, tuple] = {}  # id(program) -> (program, its twin): the program kept alive
        self._twin_next: dict[int, bool] = {}

    def pick(self, program):
        key = id(program)
        pair = self._pairs.get(key)
        if pair is None:
            pair = self._pairs[key] = (program, load_twin(program))
        twin_now = self._twin_next.get(key, False)
        self._twin_next[key] = not twin_now
        return pair[1] if twin_now else program

    def __len__(self) -> int:
        """How many programs have a twin."""
        return len(self._pairs)
