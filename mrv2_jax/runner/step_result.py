"""What a runner's `execute` returns: the sampled tokens of a step, maybe not yet on the host."""

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token (raw model logits): entry 0 is the sampled token, then the
    request's top n. `ranks[0]` is the sampled token's rank, the top n have ranks 1..n."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class StepResult:
    """A step whose tokens are already on the host (the synchronous runners).

    `logprobs()` holds, for the requests that asked for logprobs, one `TokenLogprobs` per sampled
    token (beside `result()`, whose contract the scheduler relies on)."""

    def __init__(self, sampled: dict[str, list[int]],
                 logprobs: dict[str, list[TokenLogprobs]] | None = None):
        self._sampled = sampled
        self._logprobs = logprobs or {}

    def result(self) -> dict[str, list[int]]:
        return self._sampled

    def logprobs(self) -> dict[str, list[TokenLogprobs]]:
        return self._logprobs


def token_logprobs(values, ids, sampled_rank, num_logprobs: int) -> TokenLogprobs:
    """One row of a SamplerOutput (host numpy) -> the sampled token's and top-n logprobs."""
    n = 1 + num_logprobs
    return TokenLogprobs(ids[:n].tolist(), values[:n].tolist(), [int(sampled_rank)] + list(range(1, n)))
