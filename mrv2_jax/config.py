"""Engine configuration: plain dataclasses, each validated in ``__post_init__``.

A bad value raises ``ValueError`` naming the field and what is allowed, at construction,
so a misconfiguration never surfaces later as an odd scheduling or memory failure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mrv2_jax import envs

# Static widths of a request's sparse sampler lists (shapes of the compiled steps: sample/tensors.py).
# A request with more entries is refused when it is added (engine/request_checks.py).
MAX_LOGIT_BIAS = 256
MAX_STOP_IDS = 64  # stop_token_ids + EOS ids, masked while fewer than min_tokens outputs exist

# The server's defaults (entrypoints/cli.py, core_client.py, entrypoints/openai_server.py).
ENGINE_STARTUP_TIMEOUT = 1800.0  # seconds to wait for the engine process: a cold start compiles for minutes
SERVER_SHUTDOWN_TIMEOUT = 30.0  # seconds requests in flight get to finish on SIGTERM / Ctrl-C


def _require_positive_int(owner: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{owner}.{name} must be >= 1, got {value}")


def _require_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be a bool, got {value!r}")


# Prompt tokens a step capped by SchedulerConfig.max_tokens_while_decoding must still have room for;
# with less the cap is not applied (a prompt would trickle in a few tokens per step).
MIN_PREFILL_CHUNK = 32


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
    ``stream_interval``: while any running request is streaming, a fused call runs at most this
    many steps, so a stream waits at most this many decode steps between chunks.
    ``max_tokens_while_decoding``: while requests are running, a step holds at most this many
    tokens (a new prompt is prefilled in chunks that fit) when that leaves room for at least
    ``MIN_PREFILL_CHUNK`` prompt tokens beside one token per running request, so that a step which
    admits a prompt stays in a small bucket and the running streams' gap stays short; 0: off.
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
    stream_interval: int = 1
    max_tokens_while_decoding: int = 0

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
        _require_positive_int("SchedulerConfig", "stream_interval", self.stream_interval)
        cap = self.max_tokens_while_decoding
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            raise ValueError(f"SchedulerConfig.max_tokens_while_decoding must be an int >= 0, got {cap!r}")
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


@dataclass(frozen=True)
class KernelConfig:
    """Which implementation runs each piece that has a Pallas kernel and a jnp reference.

    Every field accepts "auto" (the kernel on GPUs, the reference elsewhere); `resolved()`
    turns the config into concrete choices for a backend, once, when an engine is built, and
    the runner, model and sampler take those as static configuration. Each field but
    `attention` takes its default from an environment variable (`from_env`, mrv2_jax/envs.py).

    ``attention``: the paged attention and KV write, "pallas" or "reference".
    ``decode_attention``: with ``attention`` "pallas", the kernel of fused decode's steps (every row one
    token): "pallas" (the ragged kernel of every other step) or "mgpu" (the decode kernel on Mosaic
    GPU, pallas_kernels/paged_decode_attention_mgpu.py; Hopper-class GPUs).
    ``ragged_attention``: with ``attention`` "pallas", the kernel of every other step (mixed prefill and
    decode rows): "pallas" (the Triton kernel, pallas_kernels/ragged_paged_attention.py) or "mgpu" (the
    Mosaic GPU kernel, pallas_kernels/ragged_paged_attention_mgpu.py; Hopper-class GPUs; a mixed step's
    one-token rows then take ``decode_attention``'s kernel).
    ``sampler_logit_stats``: the sampler's pass over the logits and rank count, "kernel",
    "interpret" (the Pallas interpreter: tests) or "reference" (jnp).
    ``sampler_noise_pass``, ``sampler_slow_path``: the sampler's whole-row noise pass and
    threshold search, "kernel", "interpret" or "reference" (jnp over every row).
    For the three sampler fields "kernel" means the kernel where it runs (GPUs), the jnp
    reference elsewhere.
    ``moe_backend``: the MoE experts' grouped GEMM, "pallas", "mgpu", "ragged_dot" or "dense".
    ``sampler_truncation``: how the sampler finds the min_p / top_k / top_p cut-offs (the variants'
    ``SamplerFeatures.top_k_top_p``): "threshold" (the row's top candidates, then the whole-row pieces
    above for the rows they do not settle) or "sort" (one sort of every row). "auto": threshold on GPUs
    and where a sampler piece runs in the Pallas interpreter, sort elsewhere: with every piece in jnp
    the threshold method searches every row anyway and compiles to a larger program.
    ``decode_projections``: the projections of one request decoding alone (fused decode's one-row
    bucket, and the step program of a one-token, one-row bucket the runner adds for it) as GEMV kernels
    with the norms, residual adds and SwiGLU fused in, one token ("gemv": models/gemv_projections.py,
    pallas_kernels/gemv_triton.py; Triton, or its interpreter elsewhere; families with
    ``gemv_weights``, one device, no speculative decoding), or cuBLAS's GEMMs with the one-row bucket
    padded to 8 tokens ("xla"). "auto": "gemv" on Hopper-class GPUs, "xla" elsewhere.
    """

    attention: str = "auto"
    sampler_logit_stats: str = "auto"
    sampler_noise_pass: str = "auto"
    sampler_slow_path: str = "auto"
    moe_backend: str = "auto"
    decode_attention: str = "auto"
    ragged_attention: str = "auto"
    sampler_truncation: str = "auto"
    decode_projections: str = "auto"

    # Field -> (environment variable of its default or None, allowed values).
    CHOICES = {
        "attention": (None, ("auto", "pallas", "reference")),
        "sampler_logit_stats": ("MRV2_SAMPLER_KERNELS", envs.SWITCHES["MRV2_SAMPLER_KERNELS"].allowed),
        "sampler_noise_pass": ("MRV2_SAMPLER_NOISE_PASS", envs.SWITCHES["MRV2_SAMPLER_NOISE_PASS"].allowed),
        "sampler_slow_path": ("MRV2_SAMPLER_SLOW_PATH", envs.SWITCHES["MRV2_SAMPLER_SLOW_PATH"].allowed),
        "moe_backend": ("MRV2_MOE_BACKEND", envs.SWITCHES["MRV2_MOE_BACKEND"].allowed),
        "decode_attention": (None, ("auto", "pallas", "mgpu")),
        "ragged_attention": (None, ("auto", "pallas", "mgpu")),
        "sampler_truncation": (None, ("auto", "threshold", "sort")),
        "decode_projections": (None, ("auto", "xla", "gemv")),
    }

    def __post_init__(self) -> None:
        for name, (_, allowed) in self.CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"KernelConfig.{name} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls) -> KernelConfig:
        """Defaults from the environment (envs.py); fields without a variable stay "auto"."""
        return cls(**{name: envs.read(var) for name, (var, _) in cls.CHOICES.items() if var})

    @classmethod
    def parse(cls, spec: KernelConfig | dict | str | None) -> KernelConfig:
        """A KernelConfig, a dict of fields, or "field=value,field=value" (the CLI's `--kernels`),
        each applied over `from_env()`."""
        if isinstance(spec, KernelConfig):
            return spec
        if isinstance(spec, str):
            pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
            if any(len(p) != 2 for p in pairs):
                raise ValueError(f"kernels must be 'field=value,...' with fields from {', '.join(cls.CHOICES)}; "
                                 f"got {spec!r}")
            spec = {k.strip(): v.strip() for k, v in pairs}
        spec = dict(spec or {})
        unknown = sorted(set(spec) - set(cls.CHOICES))
        if unknown:
            raise ValueError(f"unknown kernel fields {unknown}; fields: {', '.join(cls.CHOICES)}")
        return dataclasses.replace(cls.from_env(), **spec)

    def resolved(self, backend: str | None = None) -> KernelConfig:
        """Concrete choices for `backend` (default: JAX's default backend): no "auto" left, and
        the sampler's "kernel" only on GPUs."""
        if backend is None:
            import jax

            backend = jax.default_backend()
        gpu = backend == "gpu"
        from pallas_kernels.mgpu_common import has_wgmma

        def auto(value: str, on_gpu: str, elsewhere: str) -> str:
            return (on_gpu if gpu else elsewhere) if value == "auto" else value

        def sampler(value: str) -> str:
            return ("kernel" if gpu else "reference") if value in ("auto", "kernel") else value

        pieces = [sampler(self.sampler_logit_stats), sampler(self.sampler_noise_pass), sampler(self.sampler_slow_path)]
        threshold = gpu or any(piece != "reference" for piece in pieces)  # a piece in the interpreter
        return KernelConfig(attention=auto(self.attention, "pallas", "reference"),
                            sampler_logit_stats=pieces[0], sampler_noise_pass=pieces[1], sampler_slow_path=pieces[2],
                            moe_backend=auto(self.moe_backend, "mgpu" if gpu and has_wgmma() else "pallas",
                                             "ragged_dot"),
                            decode_attention=auto(self.decode_attention, "pallas", "pallas"),
                            ragged_attention=auto(self.ragged_attention, "pallas", "pallas"),
                            sampler_truncation=(("threshold" if threshold else "sort")
                                                if self.sampler_truncation == "auto" else self.sampler_truncation),
                            decode_projections=auto(self.decode_projections, "gemv" if gpu and has_wgmma() else "xla",
                                                    "xla"))
