"""A decoder layer's projections with their neighbouring ops, as XLA runs them against one
`pallas_kernels.decode_gemv` kernel each (issue 26), at Qwen3-0.6B's shapes and 1-8 rows.

  qkv      rms_norm(x) @ W_qkv                     (K 1024, N 4096)
  o        residual + x @ W_o                      (K 2048, N 1024)
  gate_up  silu(gate) * up of rms_norm(x) @ W_gu   (K 1024, N 6144 -> 3072)
  down     residual + x @ W_down                   (K 3072, N 1024)

Each call runs the op once for each of 28 layers of a stacked `[28, K, N]` weight (the engine's
layout, each layer read in place), so the weights stream from HBM. Reported per op, rows and way:
microseconds per layer (median wall time of a call over the layers; beside it, on a GPU, the
kernels' own time from a profiler trace and their count), the weight's GB/s and the share of copy
bandwidth. Every kernel config's result is checked against the XLA way first. On a CPU (`--tiny`)
the kernel runs in Pallas's interpreter.

    python -m benchmarks.decode_gemv --rows 1 2 8 --output-json decode_gemv.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import mrv2_jax  # noqa: F401  (the engine's XLA flags)

COPY_BANDWIDTH = 3.35e12  # bytes/s, an H100 SXM's HBM3 peak (the H200's: 4.8e12)
LAYERS = 28
# op -> (K, N of the weight, the kernel's keyword arguments besides the weight).
OPS = {"qkv": (1024, 4096, {"norm": True}), "o": (2048, 1024, {"residual": True}),
       "gate_up": (1024, 6144, {"norm": True, "activation": "silu_mul"}), "down": (3072, 1024, {"residual": True})}
# Tuning tried per rows: (block_n, block_k, wave_bytes, num_warps); None: the kernel's defaults
# (block_k is capped at K's next power of two).
CONFIGS = {1: [None, (8, 4096, 65536, 16), (16, 4096, 65536, 8), (32, 4096, 131072, 16), (8, 256, 65536, 8)],
           "many": [None, (8, 64, 65536, 8), (16, 128, 65536, 8), (8, 128, 32768, 4)]}


def make_op(op: str, fn, call_args, tuning=None):
    """The op over every layer, compiled. XLA's dot merger is off: it would concatenate the layers'
    weights into one dot because the benchmark multiplies them all by the same x."""
    import jax

    kw = OPS[op][2]
    tuning = dict(zip(("block_n", "block_k", "wave_bytes", "num_warps"), tuning)) if tuning else {}

    @jax.jit
    def run(x, stack, norm_weights, residual):
        outs = []
        for layer in range(stack.shape[0]):
            outs.append(fn(x, stack, layer, norm=(norm_weights, 1e-6) if kw.get("norm") else None,
                           activation=kw.get("activation"), residual=residual if kw.get("residual") else None,
                           **tuning))
        return outs

    return run.lower(*call_args).compile({"xla_disable_hlo_passes": "dot_merger"})


def measure(op: str, rows: int, args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.timing import time_calls
    from mrv2_jax.bench.trace import profile_kernels
    from pallas_kernels.decode_gemv import decode_gemv, decode_gemv_reference

    k, n, kw = OPS[op]
    layers = LAYERS
    if args.tiny:
        k, n, layers = 128, 256, 2
    keys = jax.random.split(jax.random.key(0), 4)
    stack = (jax.random.normal(keys[0], (layers, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(keys[1], (rows, k), jnp.bfloat16)
    norm_weights = (1 + 0.1 * jax.random.normal(keys[2], (layers, k))).astype(jnp.bfloat16)
    n_out = n // 2 if kw.get("activation") else n
    residual = jax.random.normal(keys[3], (rows, n_out), jnp.bfloat16)
    call_args = (x, stack, norm_weights, residual)
    on_gpu = jax.default_backend() == "gpu"
    reference = [np.asarray(y, np.float32) for y in make_op(op, decode_gemv_reference, call_args)(*call_args)]
    results = []

    def row(way, fn, tuning=None):
        entry = {"op": op, "k": k, "n": n, "rows": rows, "way": way, "tuning": tuning}
        try:
            outs = jax.block_until_ready(fn(*call_args))
            entry["max_abs_error"] = max(float(np.max(np.abs(np.asarray(o, np.float32) - r)))
                                         for o, r in zip(outs, reference))
            seconds = statistics.median(time_calls(fn, call_args, args.runs, args.warmup)) / layers
        except Exception as exc:  # noqa: BLE001 - a config the compiler refuses is a result, reported
            results.append(entry | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            return
        kernels = profile_kernels(fn, call_args, calls=5) if on_gpu else []
        kernel_us = sum(k_["ms_per_step"] for k_ in kernels) * 1e3 / layers if kernels else None
        launches = sum(k_["launches_per_step"] for k_ in kernels) / layers if kernels else None
        weight_bytes = k * n * 2
        results.append(entry | {"us": seconds * 1e6, "kernel_us": kernel_us, "launches_per_layer": launches,
                                "gb_per_s": weight_bytes / seconds / 1e9,
                                "copy_bw_share": weight_bytes / seconds / COPY_BANDWIDTH,
                                "kernels": [k_["kernel"] for k_ in kernels[:4]]})

    row("xla", make_op(op, decode_gemv_reference, call_args))
    interpret = not on_gpu
    for tuning in CONFIGS[1 if rows == 1 else "many"][: args.max_configs]:
        def fn(*a, **kw_):
            return decode_gemv(*a, **kw_, interpret=interpret)
        way = "gemv" if tuning is None else "gemv " + "/".join(map(str, tuning))
        row(way, make_op(op, fn, call_args, tuning), tuning)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    p.add_argument("--max-configs", type=int, default=None, help="the first N tunings per rows (defaults first)")
    p.add_argument("--tiny", action="store_true", help="K=128, N=256, 2 layers (CPU tests)")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    results = [r for op in args.ops for rows in args.rows for r in measure(op, rows, args)]
    print(f"{'op':>8} {'rows':>4} {'way':>20} {'us':>7} {'kernel us':>9} {'launches':>8} {'GB/s':>6} "
          f"{'of peak':>7} {'max err':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['op']:>8} {r['rows']:>4} {r['way']:>20}  {r['error']}")
            continue
        kernel = "-" if r["kernel_us"] is None else f"{r['kernel_us']:.1f}"
        launches = "-" if r["launches_per_layer"] is None else f"{r['launches_per_layer']:.0f}"
        print(f"{r['op']:>8} {r['rows']:>4} {r['way']:>20} {r['us']:7.1f} {kernel:>9} {launches:>8} "
              f"{r['gb_per_s']:6.0f} {r['copy_bw_share']:7.1%} {r['max_abs_error']:8.3g}")
    if args.output_json:
        from mrv2_jax.bench.environment import describe_environment

        with open(args.output_json, "w") as f:
            json.dump({**describe_environment(), "settings": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
