"""One generation request as the scheduler tracks it on the host."""

from __future__ import annotations

import enum
import time

from mrv2_jax.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle of a request. Any FINISHED_* state is terminal."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    # Evicted from the running set to free KV blocks; waits to be recomputed from scratch.
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # A grammar constraint could not go on (its matcher failed, or nothing but an incomplete end
    # was left): vLLM's "error" finish reason.
    FINISHED_ERROR = enum.auto()

    # Members are singletons: identity hashing is C-level (Enum's own hashes the name in Python),
    # and the status of every running request is looked up each step.
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason ("stop", "length", "abort", "error"), None if not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Token bookkeeping of one request.

    The request keeps its prompt and its outputs as two lists; ``all_token_ids`` joins them into
    the tokens whose values the host knows (prompt + outputs received so far) when asked for, and
    ``token_ids_between`` gives a slice of that without building it. With async scheduling, tokens
    that have been scheduled to be sampled but not yet received are counted in
    ``num_output_placeholders``; their values live on the device only.
    ``num_computed_tokens`` counts tokens whose KV has been scheduled to be written (it
    advances at schedule time, so it may include placeholder positions).

    KV block ids are owned by the KV cache manager, not by the request.
    """

    # Slotted, and the fields that the scheduler reads for every running request every step come
    # first: a slotted object keeps its fields in order, so these share the object's first cache lines.
    __slots__ = ("request_id", "status", "num_computed_tokens", "num_output_placeholders", "output_token_ids",
                 "num_prompt_tokens", "max_output_tokens", "stop_ids", "first_token_time", "grammar",
                 "num_prefill_tokens", "stop_reason", "prompt_token_ids", "prompt", "sampling_params",
                 "arrival_time", "num_cached_tokens", "num_preemptions", "streaming", "streams_in_call",
                 "automaton")

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        streaming: bool = False,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt must have at least one token")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        # Tokens the latest admission prefills (the prompt, plus the outputs so far when
        # resumed after preemption): below it the next input token is a prefill token. Once
        # they are computed the request decodes: only then may it be fused or carry drafts.
        self.num_prefill_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        # Prompt tokens served from the prefix cache at first admission (a metric).
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Output length limit: max_tokens capped by what max_model_len leaves after the
        # prompt. The scheduler sets the cap when the request is added.
        self.max_output_tokens: int | None = sampling_params.max_tokens
        # The token id or stop string that ended the request, when it stopped on one.
        self.stop_reason: int | str | None = None
        # Token ids that may stop it (its stop_token_ids, and EOS unless ignored): set by the
        # scheduler when the request is added, so that most sampled tokens need no stop check.
        self.stop_ids: frozenset[int] = frozenset()
        # A client reads its tokens as they come: fused decode is capped by the stream interval,
        # unless the request streams from inside fused calls (set by EngineCore.add_request).
        self.streaming = streaming
        self.streams_in_call = False
        # Structured outputs: the compiled automaton (structured/automaton.py), set when added; for
        # a grammar, the request's own matcher (structured/grammar.py), also held in `grammar`.
        self.automaton = None
        self.grammar = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens whose values are known on the host (prompt + received outputs)."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list of the tokens whose values are known on the host (prompt + received outputs)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` for 0 <= start <= end <= num_tokens, without building the whole list."""
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}+{self.num_output_placeholders}, "
            f"computed={self.num_computed_tokens})"
        )
