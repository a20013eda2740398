"""Microbenchmark: ragged paged attention (and the KV write) against the memory/compute floor.

Run on the GPU machine:

    python -m benchmarks.attention_kernel --output-json $OUT/attention.json
    python -m benchmarks.attention_kernel --cases decode_b256_c4096 --block-n 128
    python -m benchmarks.attention_kernel --sweep decode_b256_c4096 --sweep prefill_b1_c4096

Shapes are Qwen3-0.6B's attention (16 query heads, 8 KV heads, head_dim 128, bf16, block
size 16) over one layer's worth of cache in the stacked layout (num_layers=1 by default),
random non-zero data and random (shuffled) block tables. Cases:
  decode   batch {1, 32, 128, 256} x context {512, 4096, 32768} (one query token per row; cases
           whose KV exceeds --max-kv-gib are skipped); besides the Triton kernel (impl "kernel")
           each decode case runs the Mosaic GPU decode kernel (impl "mgpu",
           paged_decode_attention_mgpu, its default config unless --mgpu-splits/--mgpu-stages;
           --no-mgpu leaves it out), timed and checked against the reference the same way;
  prefill  1 x 4096 and 8 x 1024 (whole prompts, causal);
  mixed    S2's step: 7 whole 1024-token prompts beside 1024 decode rows of 1152 tokens (8,192 query
           tokens);
  every attention case also runs the Mosaic GPU ragged kernel (impl "mgpu_ragged",
  ragged_paged_attention_mgpu, --mgpu-ragged-stages / --mgpu-ragged-block-kv for its ring and key tile;
  --no-mgpu leaves it out); each prefill case also runs JAX's dense Mosaic GPU flash attention on
  the same shapes (impl "dense_anchor", benchmarks/dense_attention_anchor.py; not with --interpret);
  kv_write 256 and 8192 tokens into the cache: kv_write_t* the Triton kernel (kv_write.write_kv),
           kv_write_mgpu_t* the Mosaic GPU one (kv_write_mgpu.write_kv_mgpu), same shapes and timing.

Timing: each jitted call chains ``inner`` dependent calls (the output is the next call's
query, so nothing can be hoisted or CSE'd), unrolled so that XLA's command buffers launch
them back to back; a sample is one call, the reported time is median(sample) / inner over
--runs samples after --warmup calls. ``inner`` (or --inner) is picked so that one call
should take >= ~2 ms, which would amortise a ~50 us host dispatch per call to a few percent; but a
call of chained kernel calls can cost the host far more (its command buffer recorded again when its
output moved), so each kernel is also timed as --runs calls dispatched back to back and waited for
once (the device's pace where the host keeps ahead), and --kernel-split traces the kernels' own time.

Figures: useful bytes = KV read (each row's context, K and V) + q + out; bandwidth = bytes /
time and its fraction of the measured 4.3 TB/s copy bandwidth. FLOPs = 4 * Hq * D * (visible
query-key pairs); TFLOP/s and its fraction of 790 TFLOP/s (bf16 dense peak). The same
figures are reported for the pure-jnp reference (the baseline), where it fits in memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import dense_attention_anchor
from benchmarks.timing import burst_seconds, copy_bandwidth, time_calls
from mrv2_jax.bench.environment import describe_environment
from mrv2_jax.bench.trace import profile_kernels
from pallas_kernels.kv_write import write_kv, write_kv_reference
from pallas_kernels.kv_write_mgpu import write_kv_mgpu
from pallas_kernels.paged_decode_attention_mgpu import default_config as mgpu_default_config
from pallas_kernels.paged_decode_attention_mgpu import paged_decode_attention_mgpu
from pallas_kernels.ragged_paged_attention import (
    default_tuning,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention_mgpu import RaggedConfig, ragged_paged_attention_mgpu

PEAK_BW = 4.3e12  # measured H200 copy bandwidth, bytes/s
PEAK_FLOPS = 790e12  # bf16 dense
HQ, HKV, D, BS = 16, 8, 128, 16
DTYPE = jnp.bfloat16
TUNING_KEYS = ("block_m", "block_n", "num_kv_splits", "num_warps", "num_stages")


# ----------------------------------------------------------------------------------------
# Cases and inputs
# ----------------------------------------------------------------------------------------


def all_cases():
    cases = {}
    for b, c in itertools.product((1, 32, 128, 256), (512, 4096, 32768)):
        cases[f"decode_b{b}_c{c}"] = dict(kind="attn", rows=b, q_len=1, ctx=c)
    cases["prefill_b1_c4096"] = dict(kind="attn", rows=1, q_len=4096, ctx=4096)
    cases["prefill_b8_c1024"] = dict(kind="attn", rows=8, q_len=1024, ctx=1024)
    cases["mixed_s2"] = dict(kind="attn", rows=7, q_len=1024, ctx=1024, decode_rows=1024, decode_ctx=1152)
    for t in (256, 8192):  # the Triton kernel, then the Mosaic GPU one at the same shape
        cases[f"kv_write_t{t}"] = dict(kind="write", tokens=t, ctx=4096, impl="triton")
        cases[f"kv_write_mgpu_t{t}"] = dict(kind="write", tokens=t, ctx=4096, impl="mosaic_gpu")
    return cases


def kv_gib(case, num_layers):
    blocks = case.get("rows", 1) * math.ceil(case["ctx"] / BS) + 16
    blocks += case.get("decode_rows", 0) * math.ceil(case.get("decode_ctx", 0) / BS)
    if case["kind"] == "write":
        blocks = math.ceil(case["tokens"] / BS) * 4 + 16
    return 2 * num_layers * blocks * HKV * BS * D * 2 / 2**30


@functools.partial(jax.jit, static_argnames=("shape",))
def random_cache(key, shape):
    """Random bf16 cache; a 4096-block random tile repeated, to avoid huge f32 temporaries."""
    n = min(shape[1], 4096)
    tile = jax.random.normal(key, (shape[0], n, *shape[2:]), jnp.float32).astype(DTYPE)
    reps = -(-shape[1] // n)
    return jnp.tile(tile, (1, reps, 1, 1, 1))[:, : shape[1]]


def attention_inputs(case, num_layers, seed=0):
    """(q, k, v, layer, block_tables, seq_lens, query_start_loc, num_seqs) for a case: ``rows`` rows of
    ``q_len`` query tokens over ``ctx`` tokens, then (mixed cases) ``decode_rows`` rows of one token over
    ``decode_ctx``."""
    shapes = [(case["q_len"], case["ctx"])] * case["rows"]
    shapes += [(1, case.get("decode_ctx", 0))] * case.get("decode_rows", 0)
    R, T = len(shapes), sum(q for q, _ in shapes)
    max_blocks = max(math.ceil(ctx / BS) for _, ctx in shapes)
    num_blocks = R * max_blocks + 16
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (num_layers, num_blocks, HKV, BS, D)
    k, v = random_cache(keys[0], shape), random_cache(keys[1], shape)
    q = jax.random.normal(keys[2], (T, HQ, D), jnp.float32).astype(DTYPE)
    perm = jax.random.permutation(keys[3], num_blocks)[: R * max_blocks]
    block_tables = perm.reshape(R, max_blocks).astype(jnp.int32)
    seq_lens = jnp.array([ctx for _, ctx in shapes], jnp.int32)
    qsl = jnp.array([0] + list(itertools.accumulate(q for q, _ in shapes)), jnp.int32)
    return (q, k, v, jnp.int32(num_layers - 1), block_tables, seq_lens, qsl, jnp.int32(R))


def attention_work(case):
    """(useful bytes, flops) of one attention call."""
    shapes = [(case["q_len"], case["ctx"])] * case["rows"]
    shapes += [(1, case.get("decode_ctx", 0))] * case.get("decode_rows", 0)
    kv_bytes = sum(2 * ctx * HKV * D * 2 for _, ctx in shapes)
    qo_bytes = sum(2 * q_len * HQ * D * 2 for q_len, _ in shapes)
    # Query j of a row sees ctx - q_len + j + 1 keys.
    pairs = sum(q_len * (ctx - q_len) + q_len * (q_len + 1) // 2 for q_len, ctx in shapes)
    return kv_bytes + qo_bytes, 4 * HQ * D * pairs


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------


def chained_attention(attn, inner):
    def run(q, *rest):
        for _ in range(inner):  # unrolled: one command buffer, each call depends on the last
            q = attn(q, *rest)
        return q

    return jax.jit(run)


def time_call(fn, args, *, inner, runs, warmup):
    return statistics.median(time_calls(fn, args, runs, warmup)) / inner


def pick_inner(args_inner, work_bytes):
    if args_inner:
        return args_inner
    floor_s = work_bytes / PEAK_BW
    expected_s = max(4 * floor_s, 5e-6)  # guess: ~25% of peak bandwidth, >= 5 us
    return int(min(20, max(1, math.ceil(2e-3 / expected_s))))


def measure(out, impl, attn, args, inner, opts, nbytes, flops):
    """The chained call of ``attn`` timed into ``out[impl]``; with --kernel-split also its kernels by family
    (us a call) into ``out[impl + "_kernels"]``, traced on the same compiled chain (a fresh one would compile
    inside the trace, under the profiler)."""
    chained = chained_attention(attn, inner)
    out[impl] = figures(time_call(chained, args, inner=inner, runs=opts.runs, warmup=opts.warmup), nbytes, flops)
    out[impl]["burst_ms"] = 1e3 * burst_seconds(chained, args, opts.runs) / inner
    if getattr(opts, "kernel_split", False):
        out[impl + "_kernels"] = [dict(kernel=k["kernel"], us_per_call=1e3 * k["ms_per_step"] / inner,
                                       launches_per_call=k["launches_per_step"] / inner)
                                  for k in profile_kernels(chained, args, calls=3)]


def figures(seconds, nbytes, flops):
    return dict(
        ms=seconds * 1e3,
        gbps=nbytes / seconds / 1e9,
        frac_bw=nbytes / seconds / PEAK_BW,
        tflops=flops / seconds / 1e12,
        frac_flops=flops / seconds / PEAK_FLOPS,
    )


def mgpu_attention(case, opts, max_blocks):
    """The Mosaic GPU decode kernel with the Triton kernel's argument order (None: not a decode case)
    and its resolved config."""
    if case["q_len"] != 1 or getattr(opts, "no_mgpu", False):
        return None, None
    config = mgpu_default_config(case["rows"], HKV, max_blocks * BS)
    overrides = dict(num_splits=getattr(opts, "mgpu_splits", None),
                     max_concurrent_steps=getattr(opts, "mgpu_stages", None))
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})

    def attn(q, k, v, layer, block_tables, seq_lens, query_start_loc, num_seqs):
        del query_start_loc  # one token per row
        return paged_decode_attention_mgpu(q, k, v, block_tables, seq_lens, num_seqs, layer=layer, sm_scale=D**-0.5,
                                           config=config, interpret=opts.interpret)

    return attn, dataclasses.asdict(config)


def mgpu_ragged_attention(opts):
    """The Mosaic GPU ragged kernel (any case) and its config."""
    overrides = dict(max_concurrent_steps=getattr(opts, "mgpu_ragged_stages", None),
                     block_kv=getattr(opts, "mgpu_ragged_block_kv", None))
    config = RaggedConfig(**{k: v for k, v in overrides.items() if v is not None})
    attn = functools.partial(ragged_paged_attention_mgpu, sm_scale=D**-0.5, config=config, interpret=opts.interpret)
    return attn, dataclasses.asdict(config)


def bench_attention(case, tuning, opts, *, with_reference=True, with_mgpu=True):
    args = attention_inputs(case, opts.num_layers)
    nbytes, flops = attention_work(case)
    inner = pick_inner(opts.inner, nbytes)
    scale = D**-0.5
    T, R = args[0].shape[0], args[4].shape[0]
    resolved = default_tuning(T, R, HQ, HKV, args[4].shape[1] * BS)
    resolved.update({k: v for k, v in tuning.items() if v is not None})
    attn = functools.partial(ragged_paged_attention, sm_scale=scale, interpret=opts.interpret, **resolved)
    out = dict(config=resolved, inner=inner, bytes=nbytes, flops=flops)
    measure(out, "kernel", attn, args, inner, opts, nbytes, flops)
    mgpu, mgpu_config = mgpu_attention(case, opts, args[4].shape[1]) if with_mgpu else (None, None)
    if mgpu is not None:
        out["mgpu_config"] = mgpu_config
        measure(out, "mgpu", mgpu, args, inner, opts, nbytes, flops)
    ragged = None
    if with_mgpu and not getattr(opts, "no_mgpu", False):
        ragged, out["mgpu_ragged_config"] = mgpu_ragged_attention(opts)
        try:  # the newest kernel fails alone: the case keeps the other kernels' figures
            measure(out, "mgpu_ragged", ragged, args, inner, opts, nbytes, flops)
        except Exception as e:
            out["mgpu_ragged_error"], ragged = f"{type(e).__name__}: {e}"[:2000], None
    if with_mgpu and not getattr(opts, "no_mgpu", False) and not opts.interpret and is_prefill(case):
        out.update(bench_dense_anchor(case, inner, opts, flops))
    if with_reference:
        # The per-token/per-row reference materialises about 2-4 copies of the gathered KV.
        ref_gib = 4 * R * args[4].shape[1] * BS * HKV * D * 2 / 2**30
        if ref_gib > opts.ref_max_gib:
            out["reference"] = dict(skipped=f"needs ~{ref_gib:.0f} GiB")
        else:
            ref = functools.partial(ragged_paged_attention_reference, sm_scale=scale)
            out["reference"] = figures(
                time_call(
                    chained_attention(ref, inner), args, inner=inner, runs=opts.runs, warmup=opts.warmup
                ),
                nbytes,
                flops,
            )
            got = chained_attention(attn, 1)(*args).astype(jnp.float32)
            want = chained_attention(ref, 1)(*args).astype(jnp.float32)
            out["max_rel_err"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            if mgpu is not None:
                got = chained_attention(mgpu, 1)(*args).astype(jnp.float32)
                out["mgpu_max_rel_err"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            if ragged is not None:
                got = chained_attention(ragged, 1)(*args).astype(jnp.float32)
                out["mgpu_ragged_max_rel_err"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    return out


def is_prefill(case):
    """Whole prompts only: each row's queries are its whole context."""
    return case["q_len"] == case["ctx"] and not case.get("decode_rows")


def bench_dense_anchor(case, inner, opts, flops):
    """JAX's dense Mosaic GPU attention on the case's shapes: {"dense_anchor": figures,
    "dense_anchor_config": ...} of its faster key tile, or {"dense_anchor_error": ...}."""
    q, k, v = dense_attention_anchor.dense_inputs(case["rows"], case["q_len"], HQ, HKV, D)
    nbytes = 2 * (q.size + k.size + v.size)  # float16: q, out, K and V once
    best, errors = None, []
    for block_kv in dense_attention_anchor.BLOCK_KV:
        try:
            seconds = time_call(chained_attention(dense_attention_anchor.dense_attention(block_kv), inner), (q, k, v),
                                inner=inner, runs=opts.runs, warmup=opts.warmup)
        except Exception as e:
            errors.append(f"block_kv={block_kv}: {type(e).__name__}: {e}"[:1000])
            continue
        if best is None or seconds < best[0]:
            best = (seconds, block_kv)
    if best is None:
        return {"dense_anchor_error": " | ".join(errors)}
    config = dict(block_q=dense_attention_anchor.BLOCK_Q, block_kv=best[1], max_concurrent_steps=2)
    return {"dense_anchor": figures(best[0], nbytes, flops), "dense_anchor_config": config}


def bench_write(case, opts):
    T = case["tokens"]
    num_blocks = math.ceil(T / BS) * 4 + 16
    shape = (opts.num_layers, num_blocks, HKV, BS, D)
    keys = jax.random.split(jax.random.key(1), 4)
    k, v = random_cache(keys[0], shape), random_cache(keys[1], shape)
    k_new = jax.random.normal(keys[2], (T, HKV, D), jnp.float32).astype(DTYPE)
    slots = jax.random.permutation(keys[3], num_blocks * BS)[:T].astype(jnp.int32)
    layer = jnp.int32(opts.num_layers - 1)
    nbytes = 2 * 2 * T * HKV * D * 2  # read k_new/v_new, write the slots
    inner = pick_inner(opts.inner, nbytes)
    out = dict(config={}, inner=inner, bytes=nbytes, flops=0)
    impl = write_kv_mgpu if case.get("impl") == "mosaic_gpu" else write_kv
    kernel = functools.partial(impl, interpret=opts.interpret)
    # One write each, without donation (the timing below donates the caches), compared exactly.
    got = jax.jit(kernel)(k, v, k_new, -k_new, slots, layer)
    want = jax.jit(write_kv_reference)(k, v, k_new, -k_new, slots, layer)
    out["matches_reference"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want))
    del got, want
    for name, fn in (("kernel", kernel), ("reference", write_kv_reference)):

        def run(k, v, k_new, slots, fn=fn):
            for i in range(inner):  # each write depends on the previous cache state
                k, v = fn(k, v, k_new + i, k_new - i, slots, layer)
            return k, v

        run = jax.jit(run, donate_argnums=(0, 1))
        state = [k, v]

        def call():
            state[:] = run(state[0], state[1], k_new, slots)
            return state[0]

        for _ in range(opts.warmup):
            jax.block_until_ready(call())
        samples = []
        for _ in range(opts.runs):
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            samples.append(time.perf_counter() - t0)
        out[name] = figures(statistics.median(samples) / inner, nbytes, 0)
        k, v = state
    return out


# ----------------------------------------------------------------------------------------
# Sweep
# ----------------------------------------------------------------------------------------


def sweep_configs(case):
    if case["q_len"] == 1:  # decode: small query tiles; vary the KV tile and the split
        grid = itertools.product([16], [32, 64, 128], [1, 2, 4, 8, 16], [4, 8], [2, 3])
    else:  # prefill: query/key tile sizes and launch shape
        grid = itertools.product([32, 64, 128], [32, 64, 128], [1], [4, 8], [2, 3])
    for m, n, s, w, st in grid:
        yield dict(block_m=m, block_n=n, num_kv_splits=s, num_warps=w, num_stages=st)


def run_sweep(name, case, opts):
    rows = []
    for cfg in sweep_configs(case):
        try:
            r = bench_attention(case, cfg, opts, with_reference=False, with_mgpu=False)
            rows.append(dict(config=cfg, **r["kernel"]))
            print(
                f"  {fmt_cfg(cfg):44s} {r['kernel']['ms']:9.4f} ms  "
                f"{100 * r['kernel']['frac_bw']:5.1f}% BW  {100 * r['kernel']['frac_flops']:5.1f}% "
                "FLOP",
                flush=True,
            )
        except Exception as e:  # e.g. out of shared memory / registers for a tile shape
            rows.append(dict(config=cfg, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(f"  {fmt_cfg(cfg):44s} failed: {type(e).__name__}", flush=True)
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    if best:
        print(
            f"best for {name}: {fmt_cfg(best['config'])}  {best['ms']:.4f} ms "
            f"({100 * best['frac_bw']:.1f}% of {PEAK_BW / 1e12:.1f} TB/s)",
            flush=True,
        )
    return dict(case=name, results=rows, best=best)


# ----------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------


def fmt_cfg(cfg):
    short = dict(block_m="m", block_n="n", num_kv_splits="s", num_warps="w", num_stages="st", num_splits="s",
                 max_concurrent_steps="st", block_q="q", block_kv="kv")
    return " ".join(f"{short[k]}={v}" for k, v in cfg.items() if k in short)


def fmt_row(name, impl, cfg, r):
    if "skipped" in r:
        return f"{name:22s} {impl:9s} {'':40s} skipped ({r['skipped']})"
    return (
        f"{name:22s} {impl:9s} {fmt_cfg(cfg):40s} {r['ms']:9.4f} {r['gbps']:9.1f} "
        f"{100 * r['frac_bw']:6.1f}% {r['tflops']:8.2f} {100 * r['frac_flops']:6.1f}%"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-json", type=pathlib.Path)
    p.add_argument(
        "--cases", default="all", help="comma-separated case names or prefixes (decode, prefill, kv_write)"
    )
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        help="case to sweep tuning configs on (repeatable); 'default' = "
        "decode_b256_c4096; with --sweep only the sweeps run",
    )
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--inner", type=int, default=0, help="chained calls per sample (0: auto)")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--max-kv-gib", type=float, default=40.0)
    p.add_argument("--ref-max-gib", type=float, default=48.0)
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--no-mgpu", action="store_true", help="decode cases: leave out the Mosaic GPU kernel")
    p.add_argument("--kernel-split", action="store_true",
                   help="also trace each attention way's kernels per call (the kernel beside the ops around it)")
    p.add_argument("--mgpu-splits", type=int, default=None, help="Mosaic GPU decode kernel: num_splits override")
    p.add_argument("--mgpu-stages", type=int, default=None,
                   help="Mosaic GPU decode kernel: max_concurrent_steps override")
    p.add_argument("--mgpu-ragged-stages", type=int, default=None,
                   help="Mosaic GPU ragged kernel: max_concurrent_steps override")
    p.add_argument("--mgpu-ragged-block-kv", type=int, default=None, help="Mosaic GPU ragged kernel: block_kv override")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="run the kernels in the Pallas interpreter (CPU smoke test only)",
    )
    for key in TUNING_KEYS:
        p.add_argument(
            "--" + key.replace("_", "-"),
            type=int,
            default=None,
            help="kernel tuning override (default: default_tuning for the case)",
        )
    opts = p.parse_args(argv)
    tuning = {k: getattr(opts, k) for k in TUNING_KEYS}

    report = dict(
        **describe_environment(),
        argv=sys.argv[1:],
        peak_bw=PEAK_BW,
        peak_flops=PEAK_FLOPS,
        results=[],
        sweeps=[],
    )
    print(
        f"# {report['date']}  jax {jax.__version__}  {report['device']}  sha {report['git_sha']}", flush=True
    )
    copy_bw = copy_bandwidth() if jax.default_backend() == "gpu" else None
    report["copy_bw"] = copy_bw
    if copy_bw:
        print(f"# this device's copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s", flush=True)

    cases = all_cases()
    if opts.sweep:
        for name in opts.sweep:
            name = "decode_b256_c4096" if name == "default" else name
            print(f"sweep {name}", flush=True)
            report["sweeps"].append(run_sweep(name, cases[name], opts))
    else:
        wanted = [c.strip() for c in opts.cases.split(",")]
        print(
            f"{'case':22s} {'impl':9s} {'config':40s} {'ms':>9s} {'GB/s':>9s} {'%BW':>7s} "
            f"{'TFLOP/s':>8s} {'%FLOP':>7s}",
            flush=True,
        )
        for name, case in cases.items():
            if "all" not in wanted and not any(name.startswith(w) for w in wanted):
                continue
            if kv_gib(case, opts.num_layers) > opts.max_kv_gib:
                print(f"{name:22s} skipped: KV {kv_gib(case, opts.num_layers):.0f} GiB", flush=True)
                continue
            try:
                if case["kind"] == "write":
                    r = bench_write(case, opts)
                else:
                    r = bench_attention(case, tuning, opts, with_reference=not opts.no_reference)
            except Exception as e:
                print(f"{name:22s} FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
                report["results"].append(dict(case=name, error=f"{type(e).__name__}: {e}"[:2000]))
                continue
            report["results"].append(dict(case=name, **case, **r))
            for impl, cfg in (("kernel", r["config"]), ("mgpu", r.get("mgpu_config")),
                              ("mgpu_ragged", r.get("mgpu_ragged_config")),
                              ("dense_anchor", r.get("dense_anchor_config")), ("reference", {})):
                if impl in r:
                    print(fmt_row(name, impl, cfg, r[impl]), flush=True)
                if "burst_ms" in r.get(impl, {}):  # calls back to back: the dispatch hidden behind the device
                    print(f"{'':22s}   {r[impl]['burst_ms'] * 1e3:9.2f} us a call dispatched back to back, "
                          f"{r['bytes'] / r[impl]['burst_ms'] / 1e6:.0f} GB/s", flush=True)
                kernels = r.get(impl + "_kernels", [])
                for k in kernels:
                    print(f"{'':22s}   {k['us_per_call']:9.2f} us x{k['launches_per_call']:.0f}  {k['kernel'][:70]}",
                          flush=True)
                if kernels:  # the device's share of the wall time above (the rest: the host's dispatch, gaps)
                    device_us = sum(k["us_per_call"] for k in kernels)
                    bytes_per_s = r["bytes"] / (device_us * 1e-6)
                    rate = f", {bytes_per_s / 1e12:.2f} TB/s" + (f", {100 * bytes_per_s / copy_bw:.1f}% of copy"
                                                                 if copy_bw else "")
                    print(f"{'':22s}   {device_us:9.2f} us of kernels a call, "
                          f"{r[impl]['ms'] * 1e3:.2f} us wall{rate}", flush=True)
            if "max_rel_err" in r:
                print(f"{'':22s} max relative error kernel vs reference: {r['max_rel_err']:.2e}", flush=True)
            if "mgpu_max_rel_err" in r:
                print(f"{'':22s} max relative error mgpu vs reference: {r['mgpu_max_rel_err']:.2e}", flush=True)
            if "mgpu_ragged_error" in r:
                print(f"{name:22s} mgpu_ragged FAILED {r['mgpu_ragged_error'][:500]}", flush=True)
            if "dense_anchor_error" in r:
                print(f"{name:22s} dense_anchor FAILED {r['dense_anchor_error'][:500]}", flush=True)
            if "mgpu_ragged_max_rel_err" in r:
                print(f"{'':22s} max relative error mgpu_ragged vs reference: {r['mgpu_ragged_max_rel_err']:.2e}",
                      flush=True)
            if "matches_reference" in r:
                print(f"{'':22s} kernel's cache == reference's: {r['matches_reference']}", flush=True)
            jax.clear_caches()  # keep compiled executables (and their buffers) from piling up

    if opts.output_json:
        opts.output_json.parent.mkdir(parents=True, exist_ok=True)
        opts.output_json.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {opts.output_json}")


if __name__ == "__main__":
    main()
