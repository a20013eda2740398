"""Which sampler features a compiled step contains, and how unused ones are skipped.

A feature no request in the batch uses must cost (almost) nothing. There are two ways to get
there, and `SamplerFeatures` (static, hashable: part of a compiled variant's key) allows both:

* **Static variants.** A feature whose flag is False is not in the program at all. A runner
  may compile a few variants per bucket (say "temperature only" and "everything") and pick, on
  the host, the smallest one that covers the batch (`covers`). Zero device cost; the price is
  compile time and memory for each extra variant, and a host check per step.

* **Runtime skips** (`runtime_skip=True`). Every feature compiled in is guarded on the device by
  a test "does any row use it?", so one variant serves every batch. On the GPU, XLA runs these
  conditionals inside its command buffers (CUDA graphs with conditional nodes), so the cost of
  an unused feature is one tiny reduction over [R] per-row values plus a conditional node.
  The catch: an XLA conditional whose result is the [R, V] logits must copy them in the branch
  that does nothing (measured in the HLO: a `copy` of f32[R, V] appears), ~70 us on an H200 at
  256 x 152K. So the sampler never lets [R, V] arrays out of a conditional:
    - truncations (min_p / top_k / top_p) run under `lax.cond` but return only per-row
      thresholds [R]; the masking itself is fused into the final argmax pass;
    - the features that rewrite the logits (logit_bias, min_tokens, penalties) sit under ONE
      conditional whose two branches each run the whole rest of the sampler and return only
      tokens [R]: the tail is traced twice (more compile time), never copied at run time. A
      batch using any of the three pays for all three compiled in (the penalty pass reads its
      count table; bias-only batches are rare).
  With runtime_skip=False, compiled-in features run unconditionally (rows that do not use them
  carry neutral values, so results are the same; only the cost differs).

Measured on an H200 (256 rows x 151,936, docs/sampler.md): the temperature-only variant takes
0.55-0.63 ms per step, the all-features variant with runtime skips on a temperature-only batch
0.77-0.89 ms. That +0.15-0.35 ms is about what a host round trip per executed conditional would
cost (~4-6 of them): XLA's default command-buffer types do not include conditionals, so each
one splits the step's CUDA graph. Inside a whole S1 step the difference measured small (+1.4%
for the plain variant below, H200, docs/benchmarks.md), but without conditionals fused decode
paid at 256 rows, and with them it did not.

So on GPUs runners compile three static variants per bucket by default (`default_variants`):
greedy (an argmax), plain sampling (temperature + seeded noise, no conditional at all) and all
(every feature, runtime skips); each step runs the first that covers its batch. Elsewhere the
default is greedy and all (a CPU runs a conditional cheaply). `vllm bench
throughput`-style runs (temperature 1, nothing else) take the plain one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

TOP_K_TOP_P_METHODS = ("threshold", "sort")


@dataclass(frozen=True)
class SamplerFeatures:
    # Rows with temperature > 0 may exist (Gumbel noise). False: every row is greedy.
    sampling: bool = True
    logit_bias: bool = False
    min_tokens: bool = False  # EOS / stop_token_ids masked until min_tokens outputs exist
    penalties: bool = False  # repetition, presence, frequency
    min_p: bool = False
    top_k: bool = False
    top_p: bool = False
    # Width n of the top-n logprobs output (0..20); None: the step returns no logprobs at all.
    num_logprobs: int | None = None
    # Prompt logprobs (top MAX_LOGPROBS) at every scheduled token of the rows that ask for them
    # (runner/model_step.py): logits for the whole token axis, under a runtime skip.
    prompt_logprobs: bool = False
    runtime_skip: bool = True
    # "threshold": k-ary search for the top-k / top-p cut-offs (a fixed number of passes over
    # the logits, no sort); "sort": one full sort per row (reference; for speed comparisons).
    top_k_top_p: str = "threshold"
    # Candidates per search pass: passes = ceil(32 / log2(arity)), arity - 1 accumulators per
    # pass. Measured on an H200 (256 x 152K, top_k + top_p): arity 4 (16 passes) 2.6 ms,
    # 16 (8 passes) 3.3 ms, 64 45 ms: XLA's reduction slows down with many accumulators.
    search_arity: int = 4

    def __post_init__(self):
        if self.top_k_top_p not in TOP_K_TOP_P_METHODS:
            raise ValueError(f"top_k_top_p must be one of {TOP_K_TOP_P_METHODS}, got {self.top_k_top_p!r}")
        if self.search_arity < 2 or self.search_arity & (self.search_arity - 1):
            raise ValueError(f"search_arity must be a power of two >= 2, got {self.search_arity}")
        if self.num_logprobs is not None and not 0 <= self.num_logprobs <= 20:
            raise ValueError(f"num_logprobs must be None or in [0, 20], got {self.num_logprobs}")

    @classmethod
    def all(cls, **overrides) -> SamplerFeatures:
        """Every feature compiled in, top-20 logprobs, prompt logprobs, runtime skips: one variant
        for any batch."""
        on = dict(sampling=True, logit_bias=True, min_tokens=True, penalties=True, min_p=True,
                  top_k=True, top_p=True, num_logprobs=20, prompt_logprobs=True)
        return cls(**(on | overrides))

    @classmethod
    def greedy(cls) -> SamplerFeatures:
        return cls(sampling=False)

    @classmethod
    def plain_sampling(cls) -> SamplerFeatures:
        """Temperature and seeded Gumbel noise only, and no conditional at all: the variant
        for batches that sample with nothing else (`bench throughput --temperature 1`)."""
        return cls(sampling=True, runtime_skip=False)

    @classmethod
    def default_variants(cls, backend: str | None = None) -> tuple[SamplerFeatures, ...]:
        """What a runner compiles per bucket unless told otherwise, cheapest first."""
        return variants_by_name(default_variant_names(backend))

    # Boolean feature flags, in a fixed order.
    FLAGS = ("sampling", "logit_bias", "min_tokens", "penalties", "min_p", "top_k", "top_p", "prompt_logprobs")

    def covers(self, needed: SamplerFeatures) -> bool:
        """True when a step compiled with `self` computes what a batch needing `needed` asks for."""
        if any(getattr(needed, f) and not getattr(self, f) for f in self.FLAGS):
            return False
        if needed.num_logprobs is not None:
            return self.num_logprobs is not None and self.num_logprobs >= needed.num_logprobs
        return True

    def replace(self, **changes) -> SamplerFeatures:
        return dataclasses.replace(self, **changes)


# Named variants, for `EngineConfig.sampler_variants` / `--sampler-variants`.
VARIANTS = {"greedy": SamplerFeatures.greedy, "plain": SamplerFeatures.plain_sampling, "all": SamplerFeatures.all}


def default_variant_names(backend: str | None = None) -> tuple[str, ...]:
    """greedy, plain, all on GPUs; greedy, all elsewhere (default: JAX's default backend). The
    plain variant exists because CUDA-graph command buffers do not record conditionals; a CPU
    runs them cheaply, and each extra variant is one more compile per bucket."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return ("greedy", "plain", "all") if backend == "gpu" else ("greedy", "all")


def variants_by_name(names) -> tuple[SamplerFeatures, ...]:
    """("greedy", "plain", "all") or a comma-separated string of them -> feature sets. The last
    must be "all" (a step with any feature falls back on it)."""
    names = tuple(n.strip() for n in names.split(",")) if isinstance(names, str) else tuple(names)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"sampler variants must be names from {sorted(VARIANTS)}, got {names!r}")
    if names[-1] != "all" or len(set(names)) != len(names):
        raise ValueError(f"sampler variants must be distinct and end with 'all', got {names!r}")
    return tuple(VARIANTS[n]() for n in names)
