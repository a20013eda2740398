"""Microbenchmark: what one executed `lax.cond` costs inside a jitted step on this device.

    python -m benchmarks.conditionals --output-json $OUT/conditionals.json

The sampler's runtime skips (sample/features.py) were `lax.cond`s, one around each optional
feature. Whether that is cheap depends on how XLA runs a conditional: as a node of the step's command
buffer (CUDA graph), or by copying the predicate to the host and launching the branch from
there. This times a chain of N conditionals whose predicates come from the device (a reduction
of the previous result, so nothing can be hoisted), each doing a tiny amount of work, against
the same chain written with `jnp.where` (both branches computed, no conditional), for several N.
The slope per conditional is the figure: µs per conditional in the chain.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

from benchmarks.timing import time_calls
from mrv2_jax.bench.environment import describe_environment, write_report


def chain(n: int, use_cond: bool):
    """f(big, small) -> small after n dependent steps; each step's predicate reads the last."""

    def f(big, small):
        small = small + jnp.sum(big[:, :8])  # some device work in front, as in a real step
        for i in range(n):
            pred = jnp.sum(small) > -1e30  # always true, but only the device knows
            on = lambda s, i=i: s * 1.0001 + i
            off = lambda s: s
            small = jax.lax.cond(pred, on, off, small) if use_cond else jnp.where(pred, on(small), off(small))
        return small

    return jax.jit(f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", type=int, nargs="*", default=[0, 4, 16])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    big = jnp.ones((256, 1024), jnp.float32)
    small = jnp.zeros((256,), jnp.float32)
    results = []
    for use_cond in (False, True):
        for n in args.counts:
            fn = chain(n, use_cond).lower(big, small).compile()
            ms = statistics.median(time_calls(fn, (big, small), args.runs, args.warmup)) * 1e3
            results.append({"conditionals": use_cond, "n": n, "median_ms": ms})
            print(f"{'lax.cond' if use_cond else 'jnp.where':10s} n={n:3d} {ms:8.3f} ms", flush=True)
    by = {(r["conditionals"], r["n"]): r["median_ms"] for r in results}
    lo, hi = min(args.counts), max(args.counts)
    per = {kind: 1e3 * (by[(kind, hi)] - by[(kind, lo)]) / (hi - lo) for kind in (False, True)} if hi > lo else {}
    if per:
        print(f"per step: lax.cond {per[True]:.1f} us, jnp.where {per[False]:.1f} us")
    report = {**describe_environment(), "results": results,
              "us_per_cond": per.get(True), "us_per_where": per.get(False)}
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
