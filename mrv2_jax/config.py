"""Engine configuration: plain dataclasses, each validated in ``__post_init__``.

A bad value raises ``ValueError`` naming the field and what is allowed, at construction,
so a misconfiguration never surfaces later as an odd scheduling or memory failure.
"""

from __future__ import annotations

from dataclasses import dataclass


def _require_positive_int(owner: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{owner}.{name} must be >= 1, got {value}")


def _require_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be a bool, got {value!r}")


@dataclass
class SchedulerConfig:
    """Limits of one engine step and of one sequence.

    ``max_num_seqs``: requests that may be running at once (also the number of rows of the
    runner's persistent state tables). ``max_num_batched_tokens``: tokens per step, summed
    over all scheduled requests. ``max_model_len``: prompt + output tokens of one request;
    ``None`` means "take it from the model's config" and must be resolved by the engine
    before a scheduler is built. ``async_scheduling``: the engine schedules step N+1 before
    it has the sampled tokens of step N (the scheduler itself is the same in both modes).
    ``num_speculative_tokens``: drafts scheduled per decoding request (0: no speculation);
    ``num_lookahead_tokens``: KV slots kept allocated past the scheduled tokens (a draft model
    writes its own drafts' KV there).
    ``max_fused_steps``: up to this many decode steps in one runner call when every running
    request decodes, none is waiting for a free slot and there are at most ``max_fused_rows``
    of them (what the runner compiled); 1 turns fused decode off.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    max_fused_steps: int = 1
    max_fused_rows: int = 0

    def __post_init__(self) -> None:
        _require_positive_int("SchedulerConfig", "max_num_seqs", self.max_num_seqs)
        _require_positive_int(
            "SchedulerConfig", "max_num_batched_tokens", self.max_num_batched_tokens
        )
        if self.max_model_len is not None:
            _require_positive_int("SchedulerConfig", "max_model_len", self.max_model_len)
        _require_bool("SchedulerConfig", "enable_chunked_prefill", self.enable_chunked_prefill)
        _require_bool("SchedulerConfig", "async_scheduling", self.async_scheduling)
        for name in ("num_speculative_tokens", "num_lookahead_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 0, got {value!r}")
        _require_positive_int("SchedulerConfig", "max_fused_steps", self.max_fused_steps)
        if not isinstance(self.max_fused_rows, int) or self.max_fused_rows < 0:
            raise ValueError(f"SchedulerConfig.max_fused_rows must be an int >= 0, got {self.max_fused_rows!r}")
        # A fused call runs K plain decode steps with no draft verification, so the scheduler
        # never mixes it with speculative rows; refuse the combination instead of ignoring one.
        if self.num_speculative_tokens > 0 and self.max_fused_steps > 1:
            raise ValueError(
                "SchedulerConfig: speculative decoding (num_speculative_tokens="
                f"{self.num_speculative_tokens}) requires max_fused_steps=1, got {self.max_fused_steps}"
            )
        # Without chunking a prompt is prefilled in one step, so the largest prompt must fit
        # in one step's token budget or it could never be scheduled.
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "SchedulerConfig.max_num_batched_tokens must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off, "
                f"got {self.max_num_batched_tokens}"
            )


@dataclass
class CacheConfig:
    """Shape and policy of the paged KV cache.

    ``block_size``: tokens per KV block; a power of two because it is a tile dimension of
    the Pallas attention kernel. ``num_gpu_blocks``: size of the block pool; ``None`` means
    "derive it from ``gpu_memory_utilization`` after the weights are loaded".
    ``enable_prefix_caching``: reuse KV blocks of identical prompt prefixes across requests.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require_positive_int("CacheConfig", "block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"CacheConfig.block_size must be a power of two, got {self.block_size}"
            )
        if self.num_gpu_blocks is not None:
            _require_positive_int("CacheConfig", "num_gpu_blocks", self.num_gpu_blocks)
        utilization = self.gpu_memory_utilization
        if not isinstance(utilization, (int, float)) or isinstance(utilization, bool):
            raise ValueError(
                f"CacheConfig.gpu_memory_utilization must be a number, got {utilization!r}"
            )
        if not 0 < utilization <= 1:
            raise ValueError(
                f"CacheConfig.gpu_memory_utilization must be in (0, 1], got {utilization}"
            )
        _require_bool("CacheConfig", "enable_prefix_caching", self.enable_prefix_caching)
