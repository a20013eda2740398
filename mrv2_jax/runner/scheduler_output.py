"""What the scheduler hands to the model runner each step: the contract with the runners (v1 and
v2 read the same object).

It describes *changes* to the runner's persistent per-request state plus this step's token
counts; the runner keeps everything else (token ids, block tables, last sampled token) itself,
so a request already running is described only by its new blocks. The scheduler (engine/)
builds it; it lives beside the runners because layers point down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mrv2_jax.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption.

    ``token_ids`` is everything to prefill: the prompt plus, for a resumed request, all
    outputs it had received (so ``len(token_ids) >= num_prompt_tokens``).
    ``num_computed_tokens`` tokens at its start are already in the KV cache (prefix hit).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Structured outputs: the request's compiled automaton (structured/automaton.py), or None.
    automaton: Any = None


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds that gets blocks this step: the blocks appended to its
    table and its ``num_computed_tokens`` before this step (equal to the runner's own count unless
    a step of it is still in flight; the runners keep their own counts, and the tests' fake devices
    check theirs against it). A running request that gets no block is not listed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """One step's plan.

    ``num_scheduled_tokens[req_id]`` tokens of each scheduled request are computed this
    step, starting at its ``num_computed_tokens``. A request samples a token this step iff
    it is in ``sampling_req_ids`` (its prefill ends this step, or it decodes); for a decode
    under async scheduling the input token is the one sampled by the previous step, which
    the runner reads from device memory.

    ``num_spec_tokens[req_id]`` (speculative decoding): the draft tokens among a decoding
    request's scheduled tokens (its last known token, then that many drafts, whose values the
    runner holds); the step emits 1 .. 1 + that many tokens for it. Absent: no drafts.

    ``cached_reqs``: the scheduled requests the runner already holds that get new blocks this
    step (a decode fills a new block every ``block_size`` tokens); the others appear only in
    ``num_scheduled_tokens``.

    ``finished_req_ids``: requests finished, aborted or preempted since the previous
    step; the runner frees their slots before adding ``new_reqs``. An output may schedule
    no tokens at all and still carry finished ids.

    ``num_fused_steps`` K > 1: a fused decode call (runner/fused.py). Every scheduled request
    is decoding and there are no new requests; the runner runs up to K decode steps in one
    call, request r computing (and sampling) at most ``num_scheduled_tokens[r]`` tokens, one
    per step. A request returns fewer only if the device saw it sample a stop id.
    """

    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    sampling_req_ids: set[str] = field(default_factory=set)
    num_spec_tokens: dict[str, int] = field(default_factory=dict)
    # The subset of finished_req_ids preempted by this very schedule() call.
    preempted_req_ids: set[str] = field(default_factory=set)
    num_fused_steps: int = 1
    # Host-side only (runners ignore it): the engine's exact Request objects scheduled, so a
    # token arriving late is never credited to a newer request that reused an aborted id.
    scheduled_requests: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_prefill_tokens(self) -> int:
        """Scheduled tokens that sample nothing: prompt chunks (and tokens recomputed after a
        preemption), i.e. what this step computes beside its decode rows."""
        if self.num_fused_steps > 1:
            return 0
        drafts = sum(self.num_spec_tokens.values()) if self.num_spec_tokens else 0
        return self.total_num_scheduled_tokens - len(self.sampling_req_ids) - drafts
