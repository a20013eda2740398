"""Step programs compiled at their first use instead of at start-up.

A demo engine on a CPU plans dozens of programs (buckets x sampler variants) and a short session
runs a few of them: compiling all of them first is most of its start-up. `LazyPrograms` stands in
for the list of one bucket's compiled variants; indexing it compiles that variant once (lowering
included), as a planned compile that the compile guard does not count.
"""

from collections.abc import Callable, Sequence

from mrv2_jax.runner.compile_guard import planned


class LazyPrograms(Sequence):
    """One bucket's programs, one per sampler variant; `make(i)` lowers and compiles variant i."""

    def __init__(self, make: Callable[[int], object], count: int):
        self._make = make
        self._programs: list = [None] * count

    def __len__(self) -> int:
        return len(self._programs)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        program = self._programs[index]
        if program is None:
            with planned():
                program = self._programs[index] = self._make(index)
        return program

    @property
    def num_compiled(self) -> int:
        return sum(p is not None for p in self._programs)
