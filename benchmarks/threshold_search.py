"""Microbenchmark: the sampler's slow-path search kernel (pallas_kernels/threshold_search.py)
by launch configuration and by how many rows need it, against the jnp search XLA runs over
every row (topk_topp.py), at serving shapes.

    python -m benchmarks.threshold_search --output-json $OUT/threshold_search.json

Device time per call from a profiler trace (benchmarks/timing.py `device_ms`). Rows with no
need cost the kernel a launch whose programs exit at once; rows that need it are searched by one
program each (the row read 17 times for top_p, 33 for top_k then top_p).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import device_ms
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.sample import topk_topp

CASES = {"top_p 0.9": (0, 0.9), "top_k 200, top_p 0.9": (200, 0.9)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--configs", nargs="+", default=["32x4x1", "64x8x1", "32x4x3", "64x8x3"],
                   metavar="TILE_BLOCKSxWARPSxSTAGES")
    p.add_argument("--needed", type=int, nargs="+", default=[256, 16, 0], help="rows that need the search")
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU smoke runs)")
    p.add_argument("--output-json")
    args = p.parse_args(argv)
    from pallas_kernels import threshold_search as kernel

    r, v = args.num_rows, args.vocab
    x = jnp.asarray(np.random.default_rng(0).normal(0, 2, (r, v)), jnp.float32)
    ones, floor = jnp.ones((r,), jnp.float32), jnp.full((r,), -jnp.inf, jnp.float32)
    row_max = jnp.max(x, axis=-1)
    rows = []
    for case, (k_value, p_value) in CASES.items():
        k, top_p = jnp.full((r,), k_value, jnp.int32), jnp.full((r,), p_value, jnp.float32)
        xla = device_ms(jax.jit(topk_topp.top_k_top_p_threshold_search), (x, floor, k, top_p), args.calls)
        rows.append(dict(case=case, impl="xla search, every row", needed=r, ms=xla))
        for config in args.configs:
            tile_blocks, num_warps, num_stages = map(int, config.split("x"))
            for n in args.needed:
                needed = jnp.arange(r) < n
                fn = jax.jit(lambda *a, tb=tile_blocks, w=num_warps, s=num_stages: kernel.threshold_search(
                    *a, interpret=args.interpret, tile_blocks=tb, num_warps=w, num_stages=s))
                ms = device_ms(fn, (x, ones, row_max, floor, k, top_p, needed), args.calls)
                rows.append(dict(case=case, impl=f"kernel {config}", needed=n, ms=ms))
    print(f"{'case':24} {'implementation':24} {'rows':>5} {'ms':>8}")
    for row in rows:
        print(f"{row['case']:24} {row['impl']:24} {row['needed']:5d} {row['ms']:8.3f}")
    if args.output_json:
        write_report(describe_environment() | {"settings": vars(args), "rows": rows}, args.output_json)


if __name__ == "__main__":
    main()
