"""Which sampler features a compiled step contains, and how unused ones are skipped.

A feature no request in the batch uses should cost little. There are two ways to get there,
and `SamplerFeatures` (static, hashable: part of a compiled variant's key) allows both:

* **Static variants.** A feature whose flag is False is not in the program at all. A runner
  may compile a few variants per bucket (say "temperature only" and "everything") and pick, on
  the host, the smallest one that covers the batch (`covers`). Zero device cost; the price is
  compile time and memory for each extra variant, and a host check per step.

* **Runtime skips** (`runtime_skip=True`). One variant serves every batch; the pieces that cost
  far more than a conditional run under a `lax.cond` on "does any row need it?": the whole-row
  threshold search (top_k > 64, or top_p on a flat row: ~2 ms at 256 x 152K on an H200), the
  whole-row noise pass (rows the top candidates do not settle: ~0.2 ms) and prompt logprobs
  (an lm-head pass over every scheduled token). top_p's mass above a min_p floor (rows with
  top_p and min_p but no top_k: one pass) runs inside the search's conditional, before it.
  Everything else compiled in runs every step: the logit edits, the one pass over the logits
  (sample/logit_stats.py), the top 64 candidates, top_p's mass without a floor (from that
  pass's block sums), the logprobs. Rows that do not use a feature carry neutral values, so
  results are the same either way; only the cost differs.

  Why not a conditional around every feature (the sampler until 2026-11-30), measured on an
  H200 (docs/sampler.md, docs/benchmarks.md):
    - an executed or skipped conditional costs ~20 us on its own (`bench conditionals`; the
      same with command buffers on or off: XLA records conditionals in its CUDA graphs by
      default, `+CONDITIONAL` changes nothing), and inside a whole decode step the three
      cheap pieces' conditionals cost more than the pieces: every feature used, step device
      time +16.6% over greedy without them vs +19.4% with them (one machine); the three
      that remain cost 0.37-0.75 ms of that step (+15.1% -> +5.6% compiled out, session 8:
      docs/benchmarks.md), which is what keeps issue 5's 15% out of reach;
    - a conditional that holds another one two levels down, or a four-way `lax.switch`, left
      the GPU idle 0.1-0.4 ms per call; the search's own two inner conditionals (one level
      down) do not;
    - a conditional returning [R, V] logits copies them in the branch that does nothing
      (~70 us), so the logit edits cannot be skipped that way;
    - XLA:GPU turns a conditional whose branch holds only elementwise ops and reductions into
      unconditional code anyway (top_p's row mass was).
  In mixed serving batches the skips rarely skip: one row using a feature turns it on.
  With runtime_skip=False, the search and the noise pass run unconditionally too.

The figures for each layout are in docs/benchmarks.md ("Sampler: fewer conditionals").

So on GPUs runners compile four static variants per bucket by default (`default_variants`):
greedy (an argmax), plain sampling (temperature + seeded noise, no conditional at all), full
(every feature but prompt logprobs: with the whole-row passes as kernels, no conditional either)
and all (every feature, runtime skips); each step runs the first that covers its batch.
Elsewhere the default is greedy and all (one compile fewer per bucket). `vllm bench throughput`-style runs
(temperature 1, nothing else) take the plain one.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
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
    def full(cls) -> SamplerFeatures:
        """Every feature but prompt logprobs. Placed before "all" (`--sampler-variants
        greedy,plain,full,all`), it runs the steps that compute no prompt logprobs, which then
        carry no prompt-logprobs conditional; steps with prompt-logprob spans run "all". One more
        compile per bucket; not a default until measured (docs/benchmarks.md)."""
        return cls.all(prompt_logprobs=False)

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
VARIANTS = {"greedy": SamplerFeatures.greedy, "plain": SamplerFeatures.plain_sampling, "full": SamplerFeatures.full,
            "all": SamplerFeatures.all}


# Benchmarks only: conditionals compiled as their skip branch, named in this variable
# (comma-separated). A step then costs what it would without them, and rows that need a
# skipped path get the fast path's answer instead: results can be wrong. It is how the cost of
# each conditional inside a real step is measured (gpu_check.sh ab-s1-conditionals).
SKIP_CONDITIONALS_ENV = "MRV2_BENCH_SKIP_CONDITIONALS"
CONDITIONALS = ("noise", "slow", "search", "prompt")  # whole-row noise pass, slow path, its searches, prompt logprobs


def skipped_conditionals() -> frozenset[str]:
    """The names in MRV2_BENCH_SKIP_CONDITIONALS (read at trace time)."""
    names = frozenset(n.strip() for n in os.environ.get(SKIP_CONDITIONALS_ENV, "").split(",") if n.strip())
    if names - set(CONDITIONALS):
        raise ValueError(f"{SKIP_CONDITIONALS_ENV} names conditionals from {CONDITIONALS}, got {sorted(names)}")
    if names:
        warnings.warn(f"{SKIP_CONDITIONALS_ENV}={','.join(sorted(names))}: those paths are compiled out; "
                      "sampling results can be wrong (benchmarks only)", stacklevel=2)
    return names


def run_if_used(runtime_skip: bool, used, compute, skip, name: str):
    """compute() if any row uses the piece (`used`: a traced bool), else skip(), by one
    `lax.cond`; with runtime skips off, always compute(). `name`: which conditional this is
    (CONDITIONALS), for MRV2_BENCH_SKIP_CONDITIONALS."""
    if not runtime_skip:
        return compute()
    if name in skipped_conditionals():
        return skip()
    import jax

    return jax.lax.cond(used, compute, skip)


PASS_MODES = ("auto", "cond", "kernel", "interpret")


def whole_row_pass_mode(env: str) -> str:
    """How a whole-row pass that few rows need skips the others, from environment variable
    `env` (read at trace time): "cond" (one `lax.cond` around it, skipped when no row needs it),
    "kernel" (a Pallas kernel whose programs skip the rows that need nothing, no conditional; on
    other backends the jnp pass over every row), "interpret" (that kernel in the Pallas
    interpreter: CPU tests) or "auto" (the default: "kernel" on GPUs, "cond" elsewhere). On an
    H200 a conditional inside the step cost far more than its microbenchmark; with the kernels
    and the `full` variant the every-feature step went from +15-21% over greedy to +9.1%
    (docs/benchmarks.md, "Sampler: no conditional in the decode step")."""
    mode = os.environ.get(env, "auto")
    if mode not in PASS_MODES:
        raise ValueError(f"{env} must be one of {PASS_MODES}, got {mode!r}")
    if mode == "auto":
        import jax

        return "kernel" if jax.default_backend() == "gpu" else "cond"
    return mode


def default_variant_names(backend: str | None = None) -> tuple[str, ...]:
    """greedy, plain, full, all on GPUs; greedy, all elsewhere (default: JAX's default backend).
    On GPUs a conditional inside the step costs ~0.3 ms, one as much as several (docs/benchmarks.md):
    plain has none, and full has none once the whole-row passes run as kernels (prompt
    logprobs' is the last). A CPU runs them cheaply, and each variant is one compile per bucket."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return ("greedy", "plain", "full", "all") if backend == "gpu" else ("greedy", "all")


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
