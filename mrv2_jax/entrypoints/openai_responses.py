"""Response bodies of the OpenAI-compatible API: whole responses, stream chunks, usage, and
logprobs in both of OpenAI's formats (the legacy completions one and the chat one).

Logprobs come from `CompletionOutput.logprobs`: one ``{token_id: Logprob}`` dict per generated
token, holding the sampled token and the top-k alternatives, each with ``logprob``, ``rank``
and ``decoded_token``. While the sampler does not fill them they are None and every
``logprobs`` field is null.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from mrv2_jax.engine.output import RequestOutput

# JSON has no -inf; OpenAI-compatible servers report impossible tokens as this.
MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# --- logprobs -----------------------------------------------------------------------------
def _finite(x) -> float:
    x = float(x)
    return x if math.isfinite(x) else MIN_LOGPROB


class LogprobFormatter:
    """Turns per-token logprob dicts into OpenAI's formats. ``top_k``: how many alternatives
    the request asked for."""

    def __init__(self, tokenizer, top_k: int):
        self.tokenizer = tokenizer
        self.top_k = top_k

    def _text(self, token_id: int, lp) -> str:
        decoded = getattr(lp, "decoded_token", None)
        if decoded is not None:
            return decoded
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def _top(self, entry: dict) -> list[tuple[int, object]]:
        def rank(item):
            r = getattr(item[1], "rank", None)
            return math.inf if r is None else r

        return sorted(entry.items(), key=rank)[: self.top_k]

    def completion(self, token_ids: list[int], entries: list[dict], text_offset: int) -> dict:
        """Legacy format: parallel lists; ``top_logprobs`` also holds the sampled token."""
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries):
            sampled = entry.get(token_id)
            text = self._text(token_id, sampled)
            top = {self._text(t, lp): _finite(lp.logprob) for t, lp in self._top(entry)}
            if sampled is not None:
                top.setdefault(text, _finite(sampled.logprob))
            body["tokens"].append(text)
            body["token_logprobs"].append(_finite(sampled.logprob) if sampled is not None else None)
            body["top_logprobs"].append(top)
            body["text_offset"].append(text_offset)
            text_offset += len(text)
        return body

    def chat(self, token_ids: list[int], entries: list[dict]) -> dict:
        """Chat format: one object per token with its top alternatives and UTF-8 bytes."""
        content = []
        for token_id, entry in zip(token_ids, entries):
            sampled = entry.get(token_id)
            text = self._text(token_id, sampled)
            top = []
            for t, lp in self._top(entry):
                alt = self._text(t, lp)
                top.append({"token": alt, "logprob": _finite(lp.logprob), "bytes": list(alt.encode())})
            content.append({"token": text, "logprob": _finite(sampled.logprob) if sampled is not None
                            else MIN_LOGPROB, "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}


@dataclass
class DeltaTracker:
    """What a stream has sent so far, to cut each new snapshot into its new part."""

    num_tokens: int = 0
    text_offset: int = 0

    def new_tokens(self, out: RequestOutput) -> tuple[list[int], list[dict] | None]:
        c = out.outputs[0]
        start, self.num_tokens = self.num_tokens, len(c.token_ids)
        entries = c.logprobs[start:len(c.token_ids)] if c.logprobs is not None else None
        return c.token_ids[start:], entries


@dataclass
class TokenCount:
    """How many tokens a stream has sent chunks for. Every output that brings new tokens gets a chunk,
    also when their text is held back (an unfinished character, or what may start a stop string):
    so a client sees one chunk per decode step, as from vLLM, and the held-back text comes later."""

    num_tokens: int = 0

    def new_tokens(self, out: RequestOutput) -> bool:
        n = len(out.outputs[0].token_ids)
        new, self.num_tokens = n > self.num_tokens, n
        return new


def completion_logprobs(fmt: LogprobFormatter | None, out: RequestOutput, tracker: DeltaTracker) -> dict | None:
    if fmt is None:  # no logprobs asked for: nothing to cut (a stream's every chunk passes here)
        return None
    token_ids, entries = tracker.new_tokens(out)
    if entries is None:
        return None
    body = fmt.completion(token_ids, entries, tracker.text_offset)
    tracker.text_offset += sum(len(t) for t in body["tokens"])
    return body


def chat_logprobs(fmt: LogprobFormatter | None, out: RequestOutput, tracker: DeltaTracker) -> dict | None:
    if fmt is None:
        return None
    token_ids, entries = tracker.new_tokens(out)
    if entries is None:
        return None
    return fmt.chat(token_ids, entries)


# --- bodies -------------------------------------------------------------------------------
def completion_response(rid: str, created: int, model: str, out: RequestOutput, logprobs: dict | None) -> dict:
    c = out.outputs[0]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}],
            "usage": usage(out), "system_fingerprint": None}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                     logprobs: dict | None, include_usage: bool) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        body["usage"] = None
    return body


def chat_response(rid: str, created: int, model: str, out: RequestOutput, logprobs: dict | None) -> dict:
    c = out.outputs[0]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                         "logprobs": logprobs, "finish_reason": c.finish_reason}],
            "usage": usage(out), "system_fingerprint": None}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None,
               logprobs: dict | None, include_usage: bool) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(rid: str, created: int, model: str, obj: str, out: RequestOutput) -> dict:
    """The extra last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(out)}
