"""Which sampler features a compiled step contains, how unused ones are skipped, and which
implementation (Pallas kernel or jnp) runs each whole-row pass.

A feature no request in the batch uses should cost little. There are two ways to get there,
and `SamplerFeatures` (static, hashable: part of a compiled variant's key) allows both:

* **Static variants.** A feature whose flag is False is not in the program at all. A runner
  may compile a few variants per bucket (say "temperature only" and "everything") and pick, on
  the host, the smallest one that covers the batch (`covers`). Zero device cost; the price is
  compile time and memory for each extra variant, and a host check per step.

* **Rows that need nothing cost next to nothing.** Everything compiled in runs every step (the
  logit edits, the one pass over the logits, the top 64 candidates, top_p's mass from the block
  sums, the logprobs); rows that do not use a feature carry neutral values, so results do not
  depend on the batch. The two whole-row passes that few rows need (the noise pass for rows
  their top candidates do not settle, and the threshold slow path) run as Pallas kernels whose
  programs exit at once for rows that need nothing (`SamplerKernels`: on GPUs), or as jnp over
  every row elsewhere. With `runtime_skip=True` prompt logprobs (an lm-head pass over every
  scheduled token) run under one `lax.cond` on "does any row ask for them?".

Conditionals are kept out of the decode step on purpose: on GPUs a conditional inside the step
cost far more than its microbenchmark, one as much as several, a nested one left the GPU idle,
and one returning [R, V] logits copies them in the branch that does nothing (docs/sampler.md;
figures in docs/benchmarks.md, "Sampler: fewer conditionals" and "Sampler: no conditional in the
decode step").

So on GPUs runners compile four static variants per bucket by default (`default_variants`):
greedy (an argmax), plain sampling (temperature + seeded noise, no conditional at all), full
(every feature but prompt logprobs: no conditional either) and all (every feature, with the
prompt-logprobs conditional); each step runs the first that covers its batch. Elsewhere the
default is all alone: there compiling is what a user waits for, and a step costs little either
way. On GPUs, `vllm bench throughput`-style runs (temperature 1, nothing else) take the plain one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

TOP_K_TOP_P_METHODS = ("threshold", "sort")
KERNEL_MODES = ("kernel", "interpret", "reference")  # each of SamplerKernels' fields


@dataclass(frozen=True)
class SamplerKernels:
    """Which implementation runs each of the sampler's whole-row pieces, already resolved for
    the backend (mrv2_jax/config.py KernelConfig does that); static, part of a variant's key.
    The defaults are the jnp paths, which run anywhere.

    logit_stats: the one pass over the logits and the rank count (logit_stats.py): "kernel"
    (compiled Pallas kernels), "interpret" (the same in the Pallas interpreter: CPU tests) or
    "reference" (jnp). noise_pass, slow_path: the whole-row noise pass (noise_pass.py) and the
    threshold slow path (slow_path.py): "kernel", "interpret" or "reference" (jnp over every row)."""

    logit_stats: str = "reference"
    noise_pass: str = "reference"
    slow_path: str = "reference"

    def __post_init__(self):
        for name in ("logit_stats", "noise_pass", "slow_path"):
            if getattr(self, name) not in KERNEL_MODES:
                raise ValueError(f"SamplerKernels.{name} must be one of {KERNEL_MODES}, got {getattr(self, name)!r}")


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
    # Structured outputs (sample/automata.py): constrained rows' logits are masked by their
    # automaton state, which the step advances; without it the step holds none of that.
    structured: bool = False
    runtime_skip: bool = True
    # "threshold": the row's top candidates, then a k-ary search for the top-k / top-p cut-offs
    # of the rows they do not settle (a fixed number of passes over the logits, no sort); "sort":
    # one full sort per row (the reference; engines take it where the sampler runs as jnp alone:
    # KernelConfig.sampler_truncation).
    top_k_top_p: str = "threshold"
    # Candidates per pass of the jnp search: passes = ceil(32 / log2(arity)), arity - 1
    # accumulators per pass; XLA's reduction slows down with many accumulators (docs/sampler.md).
    search_arity: int = 4
    kernels: SamplerKernels = SamplerKernels()

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
                  top_k=True, top_p=True, num_logprobs=20, prompt_logprobs=True, structured=True)
        return cls(**(on | overrides))

    @classmethod
    def full(cls) -> SamplerFeatures:
        """Every feature but prompt logprobs. Placed before "all" (`--sampler-variants
        greedy,plain,full,all`), it runs the steps that compute no prompt logprobs, which then
        carry no prompt-logprobs conditional; steps with prompt-logprob spans run "all". One more
        compile per bucket; a default on GPUs (default_variant_names). No structured outputs either:
        batches without constraints run as they did before them; constrained ones take
        "structured" when it is compiled, else "all"."""
        return cls.all(prompt_logprobs=False, structured=False)

    @classmethod
    def greedy(cls) -> SamplerFeatures:
        return cls(sampling=False)

    @classmethod
    def plain_sampling(cls) -> SamplerFeatures:
        """Temperature and seeded Gumbel noise only, and no conditional at all: the variant
        for batches that sample with nothing else (`bench throughput --temperature 1`)."""
        return cls(sampling=True, runtime_skip=False)

    @classmethod
    def structured_sampling(cls) -> SamplerFeatures:
        """plain with structured outputs: for batches whose constrained rows sample with a
        temperature and nothing else (`--sampler-variants greedy,plain,structured,full,all`)."""
        return cls(sampling=True, runtime_skip=False, structured=True)

    @classmethod
    def default_variants(cls, backend: str | None = None) -> tuple[SamplerFeatures, ...]:
        """What a runner compiles per bucket unless told otherwise, cheapest first."""
        return variants_by_name(default_variant_names(backend))

    # Boolean feature flags, in a fixed order.
    FLAGS = ("sampling", "logit_bias", "min_tokens", "penalties", "min_p", "top_k", "top_p", "prompt_logprobs",
             "structured")

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
VARIANTS = {"greedy": SamplerFeatures.greedy, "plain": SamplerFeatures.plain_sampling,
            "structured": SamplerFeatures.structured_sampling, "full": SamplerFeatures.full, "all": SamplerFeatures.all}


def run_if_used(runtime_skip: bool, used, compute, skip):
    """compute() if any row uses the piece (`used`: a traced bool), else skip(), by one
    `lax.cond`; with runtime skips off, always compute()."""
    if not runtime_skip:
        return compute()
    import jax

    return jax.lax.cond(used, compute, skip)


def default_variant_names(backend: str | None = None) -> tuple[str, ...]:
    """greedy, plain, full, all on GPUs; greedy, all elsewhere (default: JAX's default backend).
    On GPUs a conditional inside the step costs far more than its microbenchmark (docs/benchmarks.md):
    plain and full hold none (prompt logprobs' is the last, in all). Elsewhere (CPUs: development,
    tests, notebooks) programs compile lazily, when a step first needs one: greedy work compiles the
    greedy step, a third of all's compile time, and anything else compiles all."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return ("greedy", "plain", "full", "all") if backend == "gpu" else ("greedy", "all")


def variants_by_name(names, kernels: SamplerKernels | None = None,
                     truncation: str = "threshold") -> tuple[SamplerFeatures, ...]:
    """("greedy", "plain", "all") or a comma-separated string of them -> feature sets, each with
    `kernels` (None: the jnp defaults) and `truncation` (their top_k_top_p method). The last must
    be "all" (a step with any feature falls back on it)."""
    names = tuple(n.strip() for n in names.split(",")) if isinstance(names, str) else tuple(names)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"sampler variants must be names from {sorted(VARIANTS)}, got {names!r}")
    if names[-1] != "all" or len(set(names)) != len(names):
        raise ValueError(f"sampler variants must be distinct and end with 'all', got {names!r}")
    return tuple(VARIANTS[n]().replace(kernels=kernels or SamplerKernels(), top_k_top_p=truncation) for n in names)
