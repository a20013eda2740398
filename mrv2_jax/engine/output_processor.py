"""Turns the engine core's token deltas into user-facing `RequestOutput`s.

Owns one incremental detokenizer per request; when the detokenizer finds a stop string it
reports the request so the caller can finish it in the core (the scheduler never sees text).
Keeps each request's sample logprobs in a `LogprobStore` (engine/lazy_logprobs.py): the runner's
per-token entries are appended as they are, and the `{token_id: Logprob}` dicts, with each
token's text (cached per id: the same top tokens come back again and again), are built only when
the user reads them. Prompt logprobs, which come once per request, are built when they arrive.

Tokens streamed from inside a fused call (`streamed`, the engine process's `stream_in_call`) are
delivered as they arrive, one per decode step; the same tokens come again in the call's step
outputs, and only the ones not delivered yet are applied then. A streamed token that arrives after
its step output is dropped; one that arrives ahead of an earlier token (the step output of the
step before the call comes later: async scheduling sends it after the next call is dispatched)
waits for it.

A request added with `final_only` (offline `LLM.generate`, vLLM's FINAL_ONLY output kind) gets
no output until it finishes, and, unless it has stop strings to watch for, is detokenized once
at the end instead of every step: at 256 running requests, per-step snapshots and window
decodes are host work that sits on the critical path of every step.
"""

import time
from dataclasses import dataclass, field

from mrv2_jax.engine.detokenizer import IncrementalDetokenizer
from mrv2_jax.engine.lazy_logprobs import LogprobStore, logprob_dict
from mrv2_jax.engine.output import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from mrv2_jax.engine.request import Request
from mrv2_jax.engine.scheduler_output import EngineCoreOutput
from mrv2_jax.engine.token_ids_view import TokenIdsView


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    delta_text: str = ""
    first_token_time: float | None = None
    logprobs: LogprobStore | None = None  # None: the request asked for none
    prompt_logprobs: list | None = None  # [None, {token_id: Logprob}, ...] once known
    final_only: bool = False  # report the request only when it finishes
    defer_detokenize: bool = False  # final_only and no stop strings: decode once, at the end
    num_reported: int = 0  # tokens the engine's step outputs brought (token_ids may run ahead: streamed)
    early: dict[int, int] = field(default_factory=dict)  # streamed tokens ahead of their turn: index -> id


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tracked: dict[str, _Tracked] = {}
        self._token_text: dict[int, str] = {}

    def add(self, request: Request, final_only: bool = False) -> None:
        detok = None
        params = request.sampling_params
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer.for_request(self.tokenizer, request.prompt_token_ids, params)
        logprobs = None if params.logprobs is None else LogprobStore(self._decode_one)
        self.tracked[request.request_id] = _Tracked(request, detok, logprobs=logprobs, final_only=final_only,
                                                    defer_detokenize=final_only and not params.stop)

    def remove(self, req_ids) -> None:
        for req_id in req_ids:
            self.tracked.pop(req_id, None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """-> (outputs of the requests that changed, ids that just matched a stop string).

        An output with several tokens (a fused decode call, a speculative step) becomes one `RequestOutput` per
        token, in order, so streaming stays per token; a stop string ends the request at the
        token that completes it and the tokens after it are dropped."""
        now = time.monotonic()
        changed, stopped = [], []
        for out in core_outputs:
            t = self.tracked.get(out.req_id)
            if t is None:
                continue
            tokens = out.new_token_ids
            ahead = len(t.token_ids) - t.num_reported  # delivered already, streamed from the call
            t.num_reported += len(tokens)
            if ahead > 0:
                tokens = tokens[ahead:]
                if out.new_logprobs:
                    out.new_logprobs = out.new_logprobs[ahead:]
                if not tokens and out.finish_reason is None:
                    continue  # every token of it was streamed already
            if out.prompt_logprobs is not None:  # vLLM's layout: no logprob for the first token
                t.prompt_logprobs = [None] + [self._logprob_dict(entry) for entry in out.prompt_logprobs]
            if t.defer_detokenize and out.finish_reason is None:
                # final_only without stop strings, not finished: nothing to report, decode or
                # split into single tokens yet; only keep the tokens (the common LLM.generate step).
                if tokens and t.first_token_time is None:
                    t.first_token_time = now
                t.token_ids.extend(tokens)
                if t.logprobs is not None and out.new_logprobs:
                    t.logprobs.extend(out.new_logprobs)
                continue
            # Split into single tokens (a fused call or a speculative step brings several): a
            # stop string then ends the output at the token that completed it, and streams look
            # the same whatever the step size. An output of one token (a decode step, the common
            # case) or of none (a finish) goes whole.
            if len(tokens) <= 1:
                self._deliver(t, tokens, out.new_logprobs or None, out.finish_reason, out.stop_reason, now,
                              changed, stopped)
            else:
                for i in range(len(tokens)):
                    last = i == len(tokens) - 1
                    logprobs = out.new_logprobs[i : i + 1] if out.new_logprobs else None
                    if self._deliver(t, tokens[i : i + 1], logprobs, out.finish_reason if last else None,
                                     out.stop_reason if last else None, now, changed, stopped):
                        break
            if t.early and out.req_id in self.tracked:
                self._apply_early(t, now, changed, stopped)
        return changed, stopped

    def streamed(self, entries) -> tuple[list[RequestOutput], list[str]]:
        """Tokens streamed from inside a fused call: (req_id, index among its outputs, token) ->
        (outputs of the requests that changed, ids that just matched a stop string)."""
        now = time.monotonic()
        changed, stopped = [], []
        for req_id, index, token in entries:
            t = self.tracked.get(req_id)
            if t is None or t.final_only or index < len(t.token_ids):
                continue  # finished, not a stream, or delivered already
            t.early[index] = token
            self._apply_early(t, now, changed, stopped)
        return changed, stopped

    def _apply_early(self, t: _Tracked, now, changed: list, stopped: list) -> None:
        """Deliver the streamed tokens whose turn has come; forget the ones delivered otherwise."""
        for index in [i for i in t.early if i < len(t.token_ids)]:
            del t.early[index]
        while len(t.token_ids) in t.early:
            token = t.early.pop(len(t.token_ids))
            if self._deliver(t, [token], None, None, None, now, changed, stopped):
                return

    def _deliver(self, t: _Tracked, token_ids: list[int], logprobs, finish_reason, stop_reason, now,
                 changed: list, stopped: list) -> bool:
        """Apply one request's new tokens and collect its output -> whether the request finished (it
        is then no longer tracked)."""
        snapshot, stop_string = self._advance(t, token_ids, logprobs, finish_reason, stop_reason, now)
        if stop_string:
            stopped.append(t.request.request_id)
        if snapshot is None:
            return False
        changed.append(snapshot)
        if snapshot.finished:
            del self.tracked[t.request.request_id]
            return True
        return False

    def _advance(self, t: _Tracked, token_ids: list[int], logprobs, finish_reason, stop_reason, now,
                 ) -> tuple[RequestOutput | None, bool]:
        """Apply one request's new tokens -> (its RequestOutput, or None for a final_only request
        that has not finished; whether a stop string matched)."""
        if token_ids and t.first_token_time is None:
            t.first_token_time = now
        t.token_ids.extend(token_ids)
        if t.logprobs is not None and logprobs:
            t.logprobs.extend(logprobs)
        t.delta_text = ""
        matched = False
        if t.detokenizer is not None and (finish_reason is not None or not t.defer_detokenize):
            delta, stop_string = t.detokenizer.update(t.token_ids if t.defer_detokenize else token_ids)
            if stop_string is not None and finish_reason is None:
                finish_reason, stop_reason, matched = "stop", stop_string, True
            if finish_reason is not None:
                delta += t.detokenizer.flush()
            t.delta_text, t.text = delta, t.detokenizer.output_text
        if t.final_only and finish_reason is None:
            return None, matched
        return self._snapshot(t, finish_reason, stop_reason, now), matched

    def _logprob_dict(self, entry) -> dict[int, Logprob]:
        """A runner TokenLogprobs or LogprobRow -> {token_id: Logprob} (lazy_logprobs.logprob_dict)."""
        return logprob_dict(entry, self._decode_one)

    def _decode_one(self, token_id: int) -> str | None:
        # Also runs on the thread that reads an output's logprobs (their dicts are built then):
        # a racing reader at worst decodes a token twice.
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _snapshot(self, t: _Tracked, finish_reason, stop_reason, now) -> RequestOutput:
        # Arguments by position, in each class's field order: this runs for every streaming request at
        # every step, and keyword arguments nearly double what building a slotted dataclass costs.
        r = t.request
        completion = CompletionOutput(t.text, TokenIdsView(t.token_ids), finish_reason, stop_reason, 0,
                                      None if t.logprobs is None else t.logprobs.snapshot())
        metrics = RequestMetrics(r.arrival_time, t.first_token_time, now if finish_reason else None)
        # prompt_logprobs are set once: shared between snapshots, like their dicts.
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [completion], finish_reason is not None,
                             metrics, r.num_cached_tokens, t.prompt_logprobs, t.delta_text)
