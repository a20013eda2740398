"""Microbenchmark: the sampler's pass over the logits (sample/logit_stats.py), Pallas kernel vs
the jnp reference that XLA fuses, by tile size and warps, at serving shapes.

    python -m benchmarks.logit_stats --output-json $OUT/logit_stats.json

Each case reports the device time of its kernels per call, from a profiler trace of --calls
calls (benchmarks/timing.py `device_ms`): a host-timed burst of calls measured the ~0.1 ms
dispatch of a jitted call, not the kernel. Without device events (a CPU) the wall time per call
of a burst stands in. The floor is bytes moved / bandwidth: `gb` says how many GB one call
reads and writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import device_ms
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.sample import SamplingTensors
from mrv2_jax.sample import logit_stats as ls
from mrv2_jax.sample.penalties import PenaltyData, pack_token_mask, penalty_arrays
from pallas_kernels import logit_stats as pk


def inputs(r: int, v: int, logits_dtype, counts_dtype, rng):
    t = SamplingTensors.neutral(r, xp=jnp)
    t = dataclasses.replace(t, repetition_penalty=jnp.full((r,), 1.1, jnp.float32),
                            frequency_penalty=jnp.full((r,), 0.2, jnp.float32),
                            presence_penalty=jnp.full((r,), 0.5, jnp.float32))
    counts = rng.poisson(0.002, (r, v)).astype(counts_dtype)
    mask = pack_token_mask(rng.random((r, v)) < 0.002, np)
    data = PenaltyData(jnp.asarray(counts), jnp.asarray(mask), jnp.asarray(rng.permutation(r), jnp.int32))
    return jnp.asarray(rng.normal(0, 2, (r, v)), logits_dtype), t, data


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--tile-blocks", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--loops", nargs="+", default=["1x1", "4x1", "4x2", "4x3"], metavar="TILESxSTAGES",
                   help="tiles per program x Triton num_stages, each with tile_blocks 32 and 4 warps")
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU smoke runs)")
    p.add_argument("--output-json")
    args = p.parse_args(argv)
    r, v = args.num_rows, args.vocab
    rows = []
    for logits_dtype, counts_dtype in ((jnp.bfloat16, np.uint16), (jnp.float32, np.int32)):
        logits, t, data = inputs(r, v, logits_dtype, counts_dtype, np.random.default_rng(0))
        moved = logits.nbytes + data.output_counts.nbytes + data.prompt_mask.nbytes + r * v * 4
        label = f"{jnp.dtype(logits_dtype).name} logits, {np.dtype(counts_dtype).name} counts"
        ones = jnp.ones((r,), jnp.float32)
        penalties = penalty_arrays(t, data)
        ref = jax.jit(lambda x, t, data, ones=ones: ls.logit_stats_reference(x, t, data, ones))
        rows.append((label, "xla reference", moved, device_ms(ref, (logits, t, data), args.calls)))
        rows.append((label, "xla reference, no penalties", logits.nbytes,
                     device_ms(jax.jit(lambda x, ones=ones: ls.logit_stats_reference(x, None, None, ones)), (logits,),
                               args.calls)))
        for tb in args.tile_blocks:
            for warps in args.num_warps:
                fn = functools.partial(pk.logit_stats, tile_blocks=tb, num_warps=warps, interpret=args.interpret)
                rows.append((label, f"kernel tb={tb} warps={warps}", moved,
                             device_ms(lambda x, pen, fn=fn: fn(x, ones, pen), (logits, penalties), args.calls)))
                rows.append((label, f"kernel tb={tb} warps={warps}, no penalties", logits.nbytes,
                             device_ms(lambda x, fn=fn: fn(x, ones), (logits,), args.calls)))
        for loop in args.loops:
            tiles, stages = map(int, loop.split("x"))
            fn = functools.partial(pk.logit_stats, tiles_per_program=tiles, num_stages=stages,
                                   interpret=args.interpret)
            rows.append((label, f"kernel tb=32 warps=4 loop {loop}", moved,
                         device_ms(lambda x, pen, fn=fn: fn(x, ones, pen), (logits, penalties), args.calls)))
        stats = ref(logits, t, data)
        threshold = jnp.sort(logits.astype(jnp.float32), axis=1)[:, -30]
        count_above_xla = jax.jit(lambda x, s: jnp.sum(x.astype(jnp.float32) > s[:, None], axis=1))
        rows.append((label, "count_above xla", logits.nbytes,
                     device_ms(count_above_xla, (logits, threshold), args.calls)))
        for tb in args.tile_blocks:
            kernel = functools.partial(pk.count_above, tile_blocks=tb, interpret=args.interpret)
            rows.append((label, f"count_above kernel tb={tb}", 0,
                         device_ms(kernel, (logits, stats.raw_block_max, threshold), args.calls)))
    report = describe_environment() | {"num_rows": r, "vocab": v, "cases": [
        {"inputs": a, "case": b, "gb": m / 1e9, "ms": ms} for a, b, m, ms in rows]}
    print(f"logit_stats: {r} rows x {v} vocab on {jax.devices()[0].device_kind}")
    print(f"{'inputs':32} {'case':40} {'GB':>6} {'ms':>8} {'TB/s':>6}")
    for a, b, m, ms in rows:
        print(f"{a:32} {b:40} {m / 1e9:6.3f} {ms:8.4f} {m / 1e9 / ms:6.2f}")
    if args.output_json:
        write_report(report, args.output_json)


if __name__ == "__main__":
    main()
