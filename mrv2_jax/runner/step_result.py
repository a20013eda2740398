"""What a runner's `execute` returns: the sampled tokens of a step, maybe not yet on the host."""

from mrv2_jax.runner.token_logprobs import LogprobBlock, LogprobRow, TokenLogprobs

__all__ = ["StepResult", "TokenLogprobs", "prompt_spans", "prompt_token_logprobs"]


class StepResult:
    """A step whose tokens are already on the host (the synchronous runners).

    `logprobs()` holds, for the requests that asked for logprobs, one `LogprobRow` per sampled
    token (beside `result()`, whose contract the scheduler relies on). `prompt_logprobs()` holds,
    for the requests that asked for prompt logprobs, (prompt position of the first entry, one
    `LogprobRow` per prompt position this step computed: entry 0 of each = the prompt token
    after that position). Either may hold `TokenLogprobs` instead (the same fields, as lists)."""

    def __init__(self, sampled: dict[str, list[int]],
                 logprobs: dict[str, list[LogprobRow]] | None = None,
                 prompt_logprobs: dict[str, tuple[int, list[LogprobRow]]] | None = None):
        self._sampled = sampled
        self._logprobs = logprobs or {}
        self._prompt_logprobs = prompt_logprobs or {}

    def result(self) -> dict[str, list[int]]:
        return self._sampled

    def logprobs(self) -> dict[str, list[LogprobRow]]:
        return self._logprobs

    def prompt_logprobs(self) -> dict[str, tuple[int, list[LogprobRow]]]:
        return self._prompt_logprobs


def prompt_token_logprobs(out, spans: dict[str, tuple[int, int, int, int]]) -> dict:
    """A step's SamplerOutput prompt fields (device or host) and {req_id: (first token index,
    number of prompt positions, top n, first prompt position)} -> {req_id: (first prompt
    position, [LogprobRow per prompt position])}."""
    if not spans:
        return {}
    block = LogprobBlock.of(out.prompt_logprobs, out.prompt_token_ids, out.prompt_rank)
    return {r: (first, [LogprobRow(block, k, n) for k in range(start, start + num)])
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
