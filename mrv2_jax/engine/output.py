"""What the user gets back for a request (the result type of ``LLM.generate``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """A token's log probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (index 0: only n == 1 is supported).

    ``text`` is the detokenized output (cut before a matched stop string unless the
    request asked to include it); ``token_ids`` are the sampled tokens, including a final
    EOS or stop token. ``finish_reason`` is None while the request runs, then "stop",
    "length", "abort" or "error" (a grammar that could not go on); ``stop_reason`` is the stop
    token id or stop string that ended it, or, with "error", why.
    ``logprobs``: when the request asked for ``logprobs=n``, one dict per token of
    ``token_ids``, ``{token_id: Logprob}`` holding the sampled token (first) and the top n (n or
    n + 1 entries); values are log-softmax of the raw model logits (before penalties, temperature
    and truncation, vLLM's default ``raw_logprobs``). None otherwise. From the engine it is a
    ``LazyLogprobs`` (engine/lazy_logprobs.py), a read-only list whose dicts are built when read
    (like vLLM's ``FlatLogprobs``): it indexes, slices, iterates and compares like a list of
    dicts; ``list(...)`` gives a plain list. ``token_ids`` from the engine is likewise a read-only
    view (engine/token_ids_view.py) of the request's tokens so far, so that a step's outputs do not
    copy every request's whole output.
    """

    text: str
    token_ids: Sequence[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    index: int = 0
    logprobs: Sequence[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.monotonic()`` seconds) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """The state of one request as reported to the user: final when ``finished``, or a
    snapshot while streaming. ``num_cached_tokens``: prompt tokens that were served from
    the prefix cache instead of being computed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = field(default=None, repr=False)
    # Text added since the previous output of this request (streaming).
    delta_text: str = ""
