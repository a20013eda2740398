"""What the engine reports after each step: per-request changes and scheduler statistics.
(What the scheduler hands to the runners is runner/scheduler_output.py.)"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step changed for one request, as reported by ``update_from_output``.

    ``new_token_ids`` are the accepted tokens (tokens sampled after a stop are dropped).
    ``finish_reason`` is "stop" / "length" / "abort" / "error" once the request is finished, with
    ``stop_reason`` the stop token id that ended it (None for EOS or length; why, for "error").
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # One runner.token_logprobs.LogprobRow per new token, for requests that asked for logprobs
    # (set by the engine core beside the scheduler's result).
    new_logprobs: list | None = None
    # For a request that asked for prompt_logprobs, on its first output: one LogprobRow per
    # prompt token after the first (entry 0 of each = that prompt token), in prompt order.
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler for logging and metrics."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_evicted_blocks: int
    # Speculative decoding acceptance (spec_decode.metrics.SpecDecodeStats), None when off.
    spec_decode: object = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
