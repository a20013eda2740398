"""Turns the engine core's token deltas into user-facing `RequestOutput`s.

Owns one incremental detokenizer per request; when the detokenizer finds a stop string it
reports the request so the caller can finish it in the core (the scheduler never sees text).
Also turns the runner's per-token logprobs into `{token_id: Logprob}` dicts, with each token's
text (cached per id: the same top tokens come back again and again).
"""

import time
from dataclasses import dataclass, field

from mrv2_jax.engine.detokenizer import IncrementalDetokenizer
from mrv2_jax.engine.output import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from mrv2_jax.engine.request import Request
from mrv2_jax.engine.scheduler_output import EngineCoreOutput


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    delta_text: str = ""
    first_token_time: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # None: the request asked for none


def _detokenize(detokenizer: IncrementalDetokenizer, token_ids: list[int]):
    """-> (new text, stop string or None, the tokens kept). A step of speculative decoding brings
    several tokens: they go in one at a time, so a stop string ends the output at the token that
    completed it, exactly as without speculation."""
    if len(token_ids) <= 1:
        return *detokenizer.update(token_ids), token_ids
    delta = ""
    for n, token in enumerate(token_ids):
        piece, stop_string = detokenizer.update([token])
        delta += piece
        if stop_string is not None:
            return delta, stop_string, token_ids[: n + 1]
    return delta, None, token_ids


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tracked: dict[str, _Tracked] = {}
        self._token_text: dict[int, str] = {}

    def add(self, request: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer.for_request(self.tokenizer, request.prompt_token_ids,
                                                       request.sampling_params)
        self.tracked[request.request_id] = _Tracked(
            request, detok, logprobs=None if request.sampling_params.logprobs is None else [])

    def remove(self, req_ids) -> None:
        for req_id in req_ids:
            self.tracked.pop(req_id, None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """-> (outputs of the requests that changed, ids that just matched a stop string)."""
        now = time.monotonic()
        changed, stopped = [], []
        for out in core_outputs:
            t = self.tracked.get(out.req_id)
            if t is None:
                continue
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if out.new_token_ids and t.first_token_time is None:
                t.first_token_time = now
            new_ids = out.new_token_ids
            t.delta_text = ""
            if t.detokenizer is not None:
                delta, stop_string, new_ids = _detokenize(t.detokenizer, new_ids)
                # A stop string before the step's last token ends the request there, whatever
                # the scheduler decided about the later tokens.
                if stop_string is not None and (finish_reason is None or len(new_ids) < len(out.new_token_ids)):
                    finish_reason, stop_reason = "stop", stop_string
                    stopped.append(out.req_id)
                if finish_reason is not None:
                    delta += t.detokenizer.flush()
                t.delta_text, t.text = delta, t.detokenizer.output_text
            t.token_ids.extend(new_ids)
            if t.logprobs is not None:
                t.logprobs.extend(self._logprob_dict(entry) for entry in (out.new_logprobs or ())[: len(new_ids)])
            changed.append(self._snapshot(t, finish_reason, stop_reason, now))
            if finish_reason is not None:
                del self.tracked[out.req_id]
        return changed, stopped

    def _logprob_dict(self, entry) -> dict[int, Logprob]:
        """runner TokenLogprobs -> {token_id: Logprob}, the sampled token first (if it is also in
        the top n, its entry is kept: same logprob, rank counted as 1 + strictly larger)."""
        out: dict[int, Logprob] = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in out:
                out[token_id] = Logprob(logprob, rank, self._decode_one(token_id))
        return out

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _snapshot(self, t: _Tracked, finish_reason, stop_reason, now) -> RequestOutput:
        r = t.request
        completion = CompletionOutput(text=t.text, token_ids=list(t.token_ids),
                                      finish_reason=finish_reason, stop_reason=stop_reason,
                                      logprobs=None if t.logprobs is None else list(t.logprobs))
        metrics = RequestMetrics(arrival_time=r.arrival_time, first_token_time=t.first_token_time,
                                 finished_time=now if finish_reason else None)
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                             outputs=[completion], finished=finish_reason is not None, metrics=metrics,
                             num_cached_tokens=r.num_cached_tokens, delta_text=t.delta_text)
