"""Microbenchmark: the device sampler alone, per step, at serving shapes.

    python -m benchmarks.sampler --output-json $OUT/sampler.json
    python -m benchmarks.sampler --num-rows 1024 --cases greedy temperature all_used_threshold

Default shape: 256 rows x 151,936 vocabulary (Qwen3), f32 logits, random normal values. Each case
is one jitted `sample(...)` call with a given `SamplerFeatures` and batch; the time is the median
over --runs calls (after --warmup), each ended by block_until_ready, so it includes one dispatch
(the `dispatch` case, a jitted no-op on a tiny array, shows that floor). Cases:

  greedy, temperature             the two cheapest static variants
  all_unused                      every feature compiled in with runtime skips, a batch that uses
                                  only temperature: the cost of features nobody uses (vs temperature)
  all_used_{threshold,sort}       every feature used by every row (T 0.8, top_k 50, top_p 0.9,
                                  min_p 0.05, penalties, 16 biased ids, min_tokens stops, 20 logprobs)
  all_used_static                 the same, compiled without runtime skips
  top_k_{threshold,sort}, top_p_{threshold,sort}, top_k_top_p_{threshold,sort}
  top_p_peaked                    top_p alone on rows whose top 64 tokens hold most of the mass
                                  (the fast path); top_p_threshold is the flat-row search
  top_k_top_p_arity16             top_p-only search with 16-ary passes (default 4)
  noise_threefry, noise_hash      argmax(logits + noise) alone, with the former threefry noise and
                                  with the counter hash the sampler uses (sample/gumbel.py)
  penalties, logit_bias, logprobs the other features alone (on top of temperature)
  top64_blocks_*, top20_blocks_* the exact top n alone (sample/block_top.py), by block sizes

--timeline CASE... prints the device events of one call of those cases in order, with the idle
gaps between them; --hlo-dir writes each case's optimized HLO.

--profile traces 10 more calls of each case with jax.profiler and prints, per call, the kernels
(by family) that take its device time: where a case's time goes, for tuning the sampler.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import time_calls
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.bench.trace import call_timeline, profile_kernels
from mrv2_jax.config import KernelConfig
from mrv2_jax.engine.builder import sampler_kernels
from mrv2_jax.sample import SamplerFeatures, SamplingTensors, sample
from mrv2_jax.sample.gumbel import gumbel_noise
from mrv2_jax.sample.penalties import PenaltyData, pack_token_mask

T = SamplerFeatures()  # temperature only, runtime skips on
ALL_STATIC = SamplerFeatures.all(runtime_skip=False)


def _cases():
    """name -> (features, which rows' parameters: "greedy" | "temperature" | "all" | dict)."""
    trunc = dict(top_k=50, top_p=0.9)
    cases = {
        "greedy": (SamplerFeatures.greedy(), "greedy"),
        "temperature": (T, "temperature"),
        "all_unused": (SamplerFeatures.all(), "temperature"),
        "all_used_threshold": (SamplerFeatures.all(), "all"),
        "all_used_sort": (SamplerFeatures.all(top_k_top_p="sort"), "all"),
        "all_used_static": (ALL_STATIC, "all"),
        "penalties": (T.replace(penalties=True), dict(repetition_penalty=1.1, presence_penalty=0.5)),
        "logit_bias": (T.replace(logit_bias=True), dict(bias=True)),
        "logprobs": (T.replace(num_logprobs=20), dict(num_logprobs=20)),
    }
    for method in ("threshold", "sort"):
        cases[f"top_k_{method}"] = (T.replace(top_k=True, top_k_top_p=method), dict(top_k=50))
        cases[f"top_p_{method}"] = (T.replace(top_p=True, top_k_top_p=method), dict(top_p=0.9))
        cases[f"top_k_top_p_{method}"] = (T.replace(top_k=True, top_p=True, top_k_top_p=method), trunc)
    # A peaked row (as a real model's mostly are): top_p alone finishes on the top 64 values.
    cases["top_p_peaked"] = (T.replace(top_p=True), dict(top_p=0.9, peaked=True))
    cases["top_k_top_p_arity16"] = (T.replace(top_k=True, top_p=True, search_arity=16), dict(top_p=0.9))
    return cases


def make_inputs(kind, r, v, rng):
    t = SamplingTensors.neutral(r)
    cols = {f.name: np.array(getattr(t, f.name)) for f in dataclasses.fields(t)}
    if kind != "greedy":
        cols["temperature"][:] = 1.0
        cols["seeds"][:] = rng.integers(0, 2**31, r)
    if kind == "all":
        params = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                      presence_penalty=0.5, frequency_penalty=0.2, bias=True, min_tokens=True, num_logprobs=20)
    else:
        params = kind if isinstance(kind, dict) else {}
    for name, value in params.items():
        if name == "peaked":
            continue
        if name == "bias":
            cols["bias_ids"][:, :16] = rng.integers(0, v, (r, 16))
            cols["bias_values"][:, :16] = rng.uniform(-5, 5, (r, 16))
        elif name == "min_tokens":
            cols["min_tokens"][:], cols["stop_ids"][:, :2] = 10, rng.integers(0, v, (r, 2))
        else:
            cols[name][:] = value
    logits = rng.normal(0, 2, (r, v)).astype(np.float32)
    if params.get("peaked"):
        logits[np.arange(r)[:, None], rng.integers(0, v, (r, 40))] += 14
    counts = rng.poisson(0.002, (r, v)).astype(np.int32)
    mask = pack_token_mask(rng.random((r, v)) < 0.002, np)
    penalties = PenaltyData(jnp.asarray(counts), jnp.asarray(mask), jnp.arange(r, dtype=jnp.int32))
    return (jnp.asarray(logits), SamplingTensors(**{k: jnp.asarray(c) for k, c in cols.items()}),
            jnp.asarray(rng.integers(0, 4096, r), jnp.int32), penalties)


def timed(name, fn, args_, args, compile_s: float = 0.0) -> dict:
    """A case's report entry: median, min and p90 ms of `args.runs` calls of fn(*args_)."""
    ms = sorted(s * 1e3 for s in time_calls(fn, args_, args.runs, args.warmup))
    return {"case": name, "median_ms": statistics.median(ms), "min_ms": ms[0],
            "p90_ms": ms[int(0.9 * (len(ms) - 1))], "runs": len(ms), "compile_s": compile_s}


def run_case(name, features, kind, args):
    # The kernels the engine would pick on this backend (KernelConfig, from the environment).
    features = features.replace(kernels=sampler_kernels(KernelConfig.from_env().resolved()))
    rng = np.random.default_rng(0)
    inputs = make_inputs(kind, args.num_rows, args.vocab, rng)
    fn = jax.jit(lambda x, t, p, pen: sample(x, t, p, features, pen if features.penalties else None))
    t0 = time.perf_counter()
    compiled = fn.lower(*inputs).compile()
    compile_s = time.perf_counter() - t0
    result = timed(name, compiled, inputs, args, compile_s) | {"features": dataclasses.asdict(features)}
    if args.profile:
        result["kernels"] = profile_kernels(compiled, inputs)
    if args.hlo_dir:
        import os

        os.makedirs(args.hlo_dir, exist_ok=True)
        with open(os.path.join(args.hlo_dir, f"{name}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
    if name in (args.timeline or ()):
        result["timeline"] = call_timeline(compiled, inputs)
    return result


def threefry_gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab_size: int) -> jax.Array:
    """[R, vocab] float32 Gumbel noise from threefry keys folded from (seed, position): the
    sampler's noise before the counter hash of sample/gumbel.py, kept as this benchmark's baseline."""
    def row(seed, pos):
        key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), pos)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return jax.vmap(row)(seeds, positions)


NOISE_CASES = {"noise_threefry": threefry_gumbel_noise, "noise_hash": gumbel_noise}


def run_noise_case(name, args):
    """One fused pass argmax(logits + noise): the cost of making the noise."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 2, (args.num_rows, args.vocab)).astype(np.float32))
    seeds = jnp.asarray(rng.integers(0, 2**31, args.num_rows), jnp.int32)
    positions = jnp.asarray(rng.integers(0, 4096, args.num_rows), jnp.int32)
    noise = NOISE_CASES[name]
    fn = jax.jit(lambda x, s, p: jnp.argmax(x + noise(s, p, x.shape[-1]), axis=-1))
    return timed(name, fn.lower(logits, seeds, positions).compile(), (logits, seeds, positions), args)


# top_n_by_blocks alone: n, block sizes per level (sample/block_top.py).
TOP_N_CASES = {"top64_blocks_128_16": (64, (128, 16)), "top64_blocks_256_32_4": (64, (256, 32, 4)),
               "top64_blocks_128": (64, (128,)), "top20_blocks_128_16": (20, (128, 16)),
               "top20_blocks_256_32_4": (20, (256, 32, 4))}


def run_top_n_case(name, args):
    from mrv2_jax.sample.block_top import top_n_by_blocks

    n, blocks = TOP_N_CASES[name]
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 2, (args.num_rows, args.vocab)).astype(np.float32))
    return timed(name, jax.jit(lambda x: top_n_by_blocks(x, n, blocks)).lower(logits).compile(), (logits,), args)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cases", nargs="*", default=None, help="subset of case names (default: all)")
    p.add_argument("--profile", action="store_true", help="print each case's kernel split (jax.profiler)")
    p.add_argument("--timeline", nargs="*", default=None,
                   help="cases whose device events of one call to print in order, with the gaps")
    p.add_argument("--hlo-dir", default=None, help="write each case's optimized HLO there (fusion boundaries)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    cases = _cases()
    names = args.cases or list(cases)
    unknown = set(names) - set(cases) - {"dispatch", *NOISE_CASES, *TOP_N_CASES}
    if unknown:
        p.error(f"unknown case(s) {sorted(unknown)}; choose from {['dispatch', *cases]}")

    results = []
    for name in [n for n in NOISE_CASES if n in names]:
        results.append(run_noise_case(name, args))
    for name in [n for n in TOP_N_CASES if n in names]:
        results.append(run_top_n_case(name, args))
    names = [n for n in names if n not in NOISE_CASES and n not in TOP_N_CASES]
    if args.cases is None or "dispatch" in names:
        tiny = jnp.zeros((8,), jnp.float32)
        results.append(timed("dispatch", jax.jit(lambda x: x + 1).lower(tiny).compile(), (tiny,), args))
    print(f"sampler: {args.num_rows} rows x {args.vocab} vocab on {jax.devices()[0].device_kind}")
    print(f"{'case':28s} {'median ms':>10s} {'min ms':>9s} {'p90 ms':>9s} {'compile s':>10s}")
    for r in results:
        print(f"{r['case']:28s} {r['median_ms']:10.3f} {r['min_ms']:9.3f} {r['p90_ms']:9.3f} {r['compile_s']:10.1f}")
    for name in names:
        if name == "dispatch":
            continue
        features, kind = cases[name]
        r = run_case(name, features, kind, args)
        results.append(r)
        print(f"{name:28s} {r['median_ms']:10.3f} {r['min_ms']:9.3f} {r['p90_ms']:9.3f} {r['compile_s']:10.1f}",
              flush=True)
        for e in r.get("timeline", []):
            print(f"    +{e['at_us']:8.1f} us {e['us']:7.1f} us (gap {e['gap_us']:6.1f}) {e['kernel'][:60]}")
        for k in r.get("kernels", []):
            print(f"    {k['kernel'][:56]:56s} {k['ms_per_step']:8.4f} ms x{k['launches_per_step']:.0f} "
                  f"{k['share']:6.1%}", flush=True)
    report = {**describe_environment(), "num_rows": args.num_rows, "vocab": args.vocab, "results": results}
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
