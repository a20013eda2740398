"""What a runner's `execute` returns: the sampled tokens of a step, maybe not yet on the host."""


class StepResult:
    """A step whose tokens are already on the host (the synchronous runners)."""

    def __init__(self, sampled: dict[str, list[int]]):
        self._sampled = sampled

    def result(self) -> dict[str, list[int]]:
        return self._sampled
