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
    token (beside `result()`, whose contract the scheduler relies on). `prompt_logprobs()` holds,
    for the requests that asked for prompt logprobs, (prompt position of the first entry, one
    `TokenLogprobs` per prompt position this step computed: entry 0 of each = the prompt token
    after that position)."""

    def __init__(self, sampled: dict[str, list[int]],
                 logprobs: dict[str, list[TokenLogprobs]] | None = None,
                 prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None):
        self._sampled = sampled
        self._logprobs = logprobs or {}
        self._prompt_logprobs = prompt_logprobs or {}

    def result(self) -> dict[str, list[int]]:
        return self._sampled

    def logprobs(self) -> dict[str, list[TokenLogprobs]]:
        return self._logprobs

    def prompt_logprobs(self) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        return self._prompt_logprobs


def token_logprobs(values, ids, sampled_rank, num_logprobs: int) -> TokenLogprobs:
    """One row of a SamplerOutput (host numpy) -> the sampled token's and top-n logprobs."""
    n = 1 + num_logprobs
    return TokenLogprobs(ids[:n].tolist(), values[:n].tolist(), [int(sampled_rank)] + list(range(1, n)))


def prompt_token_logprobs(out, spans: dict[str, tuple[int, int, int, int]]) -> dict:
    """A step's SamplerOutput prompt fields (device or host) and {req_id: (first token index,
    number of prompt positions, top n, first prompt position)} -> {req_id: (first prompt
    position, [TokenLogprobs per prompt position])}."""
    if not spans:
        return {}
    import numpy as np

    values, ids, ranks = (np.asarray(a) for a in (out.prompt_logprobs, out.prompt_token_ids, out.prompt_rank))
    return {r: (first, [token_logprobs(values[k], ids[k], ranks[k], n) for k in range(start, start + num)])
            for r, (start, num, n, first) in spans.items()}


def prompt_spans(req_ids, positions_start, counts, num_prompt, top_n, token_start):
    """For each row asking for prompt logprobs (top_n >= 0): the scheduled tokens whose next
    token is still a prompt token -> {req_id: (first token index, how many, top n, position)}."""
    spans = {}
    for i, r in enumerate(req_ids):
        if top_n[i] >= 0:
            num = max(0, min(int(counts[i]), int(num_prompt[i]) - 1 - int(positions_start[i])))
            if num:
                spans[r] = (int(token_start[i]), num, int(top_n[i]), int(positions_start[i]))
    return spans
