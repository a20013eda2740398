"""How close a decode step's projections come to streaming their weights at the memory floor, for
M <= 32 rows (issue 26): XLA's dot (cuBLAS on GPUs) against jax's shipped Hopper matmul on Pallas
Mosaic GPU (`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`) and our split-K weight-streaming
kernel (`pallas_kernels.skinny_gemm_mgpu`), at Qwen3-0.6B's shapes.

  xla     y[M, N] = x[M, K] @ W[K, N], one dot per layer's weight
  mgpu    y^T[N, 64] = W^T[N, K] @ x^T[K, 64]: the weight is the kernel's big operand and the rows
          its small one, padded to 64 (the shipped kernel's smallest tile on that side)
  reduce  the same product as a multiply and a sum over K in f32: no cuBLAS call, XLA's own
          reduction kernel (which could take an elementwise prologue such as SiLU x up)
  splitk  skinny_matmul(x, W): the rows padded to 8/16/32, K split so that even a 1024-wide
          output makes a few hundred CTAs, f32 partials summed by a second (XLA) op; both times
          (wall and kernels') include the padding and the sum. Configs: `auto` (the kernel's default rule: at least 2
          CTAs per SM), `ctas1` and `ctas4` (the rule aiming at 1 or 4 CTAs per SM: fewer, longer
          CTAs and fewer partials, or more and shorter), `tk128` (128-deep K tiles), `tn128`
          (128-wide output tiles: fewer x bytes per weight byte), `nosplit` (K whole in every CTA: no
          partials to sum, the kernel stores the bf16 product)

Each call runs the projection once for each of `--layers` distinct weights (as a decode step does
over its layers), so the weights stream from HBM and not from L2. With `--stacked` those weights are
one `[layers, K, N]` array, as the engine holds them, and each projection reads its layer in place
(xla: `x @ w[l]`, XLA's dynamic-slice fusion; splitk: `layer=l`); the mgpu way is then skipped.
Reported per shape, rows and way:
microseconds per projection (median over calls, divided by the layers; beside it, on a GPU, the
kernels' own time from a profiler trace), GB/s of weight read and the share of the 4.3 TB/s copy
bandwidth; the mgpu way, whose time does not depend on the rows, at the largest `--rows` only (the
splitk way at every `--rows` value: its work depends on them). Every mgpu and splitk result is
checked against the XLA dot first. On a CPU both run in Mosaic GPU's interpreter (tests, tiny
shapes), after their configs are lowered for CUDA (which refuses tilings the interpreter runs).

    python -m benchmarks.skinny_gemm --rows 1 8 32 --output-json skinny_gemm.json
    python -m benchmarks.skinny_gemm --ways splitk --splitk-configs auto,ctas1 --rows 1 8 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import mrv2_jax  # noqa: F401  (the engine's XLA flags)

COPY_BANDWIDTH = 4.3e12  # bytes/s, the H200's measured copy bandwidth (docs/benchmarks.md)
# Qwen3-0.6B's projections: name -> (K, N, copies per decode step).
SHAPES = {"qkv_proj": (1024, 4096, 28), "o_proj": (2048, 1024, 28), "gate_up_proj": (1024, 6144, 28),
          "down_proj": (3072, 1024, 28), "lm_head": (1024, 151936, 1)}
MGPU_ROWS = 64  # the shipped kernel's smallest tile on the rows' side (its B tile is 64 wide)
H200_SMS = 132
# The split-K kernel's configs: name -> keyword arguments of skinny_gemm_mgpu.default_config.
SPLITK_RULES = {"auto": {}, "ctas1": {"ctas_per_sm": 1}, "ctas4": {"ctas_per_sm": 4}, "tk128": {"tile_k": 128},
                "tn128": {"tile_n": 128}, "nosplit": {"splits": 1}}


def splitk_config(name: str, rows: int, k: int, n: int):
    from pallas_kernels import skinny_gemm_mgpu as sk

    return sk.default_config(rows, k, n, **SPLITK_RULES[name])


def splitk_lowers_for_cuda(config, rows: int, k: int, n: int) -> None:
    """Raise what the Mosaic GPU lowering for CUDA refuses of the split-K kernel (on any backend)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import skinny_gemm_mgpu as sk

    x_t, w_t = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    jax.jit(lambda x, w: sk.skinny_matmul(x, w, config=config)).trace(x_t, w_t).lower(lowering_platforms=("cuda",))


def mgpu_configs():
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    # Both warpgroups split the weight's rows (M); the rows' side is one 64-wide tile, which the
    # real lowering needs (a 32-wide tile per warpgroup lowers in the interpreter but not for CUDA).
    m = hm.MatmulDimension.M
    return {f"tm{tm}_tk{tk}_s{steps}": hm.TuningConfig(tile_m=tm, tile_n=MGPU_ROWS, tile_k=tk,
                                                       max_concurrent_steps=steps, epi_tile_n=64, epi_tile_m=64,
                                                       wg_dimension=m)
            for tm, tk, steps in ((64, 64, 4), (64, 64, 8), (128, 64, 3), (128, 64, 4))}


def lowers_for_cuda(config, k: int, n: int) -> None:
    """Raise what the Mosaic GPU lowering for CUDA refuses (run on any backend: the interpreter
    accepts tilings the real lowering does not)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    hm.get_num_sms = lambda: H200_SMS  # no GPU to ask; the grid the H200 would get
    w_t, x_t = jax.ShapeDtypeStruct((n, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, MGPU_ROWS), jnp.bfloat16)
    jax.jit(lambda w, x: hm.matmul(w, x, None, config)).trace(w_t, x_t).lower(lowering_platforms=("cuda",))


def _as_reduction(x, w):
    import jax.numpy as jnp

    return jnp.sum(x[:, :, None].astype(jnp.float32) * w[None].astype(jnp.float32), axis=1).astype(x.dtype)


def projections(way: str, config=None, stacked: bool = False):
    """A jitted function of (x, weights) running the projection once per weight (`stacked`: once
    per layer of one [L, K, N] array)."""
    import jax

    if way == "xla":
        if stacked:
            return jax.jit(lambda x, ws: [x @ ws[j] for j in range(ws.shape[0])])
        return jax.jit(lambda x, ws: [x @ w for w in ws])
    if way == "reduce":
        if stacked:
            return jax.jit(lambda x, ws: [_as_reduction(x, ws[j]) for j in range(ws.shape[0])])
        return jax.jit(lambda x, ws: [_as_reduction(x, w) for w in ws])
    if way == "splitk":
        from pallas_kernels import skinny_gemm_mgpu as sk

        interpret = jax.default_backend() != "gpu"
        if stacked:
            return jax.jit(lambda x, ws: [sk.skinny_matmul(x, ws, layer=j, config=config, interpret=interpret)
                                          for j in range(ws.shape[0])])
        return jax.jit(lambda x, ws: [sk.skinny_matmul(x, w, config=config, interpret=interpret) for w in ws])
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    def run(xt, ws):
        return [hm.matmul(w, xt, None, config) for w in ws]

    if jax.default_backend() == "gpu":
        return jax.jit(run)

    def interpreted(xt, ws):
        with plgpu.force_gpu_interpret_mode():
            return run(xt, ws)

    hm.get_num_sms = lambda: 4  # no GPU to ask: a few programs at once is enough for the interpreter
    return interpreted


def measure(name: str, k: int, n: int, layers: int, rows: int, args, with_mgpu: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.timing import time_calls
    from mrv2_jax.bench.trace import profile_kernels

    keys = jax.random.split(jax.random.key(0), layers + 1)
    weights = [jax.random.normal(keys[i], (k, n), jnp.bfloat16) * 0.02 for i in range(layers)]
    if args.stacked:
        weights = jnp.stack(weights)
    x = jax.random.normal(keys[-1], (rows, k), jnp.bfloat16)
    weight_bytes = k * n * 2
    results = []

    def row(way, fn, call_args, check=None):
        entry = {"shape": name, "k": k, "n": n, "rows": rows, "way": way}
        try:
            outs = jax.block_until_ready(fn(*call_args))
            if check is not None:
                entry["max_abs_error"] = check(outs)
            seconds = statistics.median(time_calls(fn, call_args, args.runs, args.warmup)) / layers
        except Exception as exc:  # noqa: BLE001 - a config the kernel refuses is a result, reported
            results.append(entry | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            return
        # The device's own time (a profiler trace; none on a CPU): what the call's wall time holds
        # besides the kernels shows as the difference.
        kernels = profile_kernels(fn, call_args, calls=5) if jax.default_backend() == "gpu" else []
        kernel_us = sum(k["ms_per_step"] for k in kernels) * 1e3 / layers if kernels else None
        results.append(entry | {"us": seconds * 1e6, "gb_per_s": weight_bytes / seconds / 1e9,
                                "copy_bw_share": weight_bytes / seconds / COPY_BANDWIDTH, "kernel_us": kernel_us,
                                "kernels": [k["kernel"] for k in kernels[:3]]})

    xla_fn = projections("xla", stacked=args.stacked)
    reference = [np.asarray(y, np.float32) for y in xla_fn(x, weights)]
    row("xla", xla_fn, (x, weights))

    def check_rows(outs):
        return max(float(np.max(np.abs(np.asarray(o, np.float32) - r))) for o, r in zip(outs, reference))

    if "reduce" in args.ways:
        row("reduce", projections("reduce", stacked=args.stacked), (x, weights), check_rows)
    for config_name in args.splitk_configs if "splitk" in args.ways else ():
        way = f"splitk {config_name}"
        try:
            config = splitk_config(config_name, rows, k, n)
            if jax.default_backend() != "gpu":
                splitk_lowers_for_cuda(config, rows, k, n)
        except Exception as exc:  # noqa: BLE001 - reported like a refusal on the GPU
            results.append({"shape": name, "k": k, "n": n, "rows": rows, "way": way,
                            "error": f"config or CUDA lowering: {type(exc).__name__}: {str(exc)[:200]}"})
            continue
        row(way, projections("splitk", config, args.stacked), (x, weights), check_rows)
        results[-1]["config"] = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if not with_mgpu or args.stacked:
        return results
    weights_t = [w.T.copy() for w in weights]
    x_t = jnp.zeros((k, MGPU_ROWS), jnp.bfloat16).at[:, :rows].set(x.T)
    for config_name, config in args.configs.items():
        def check(outs):
            return max(float(np.max(np.abs(np.asarray(o, np.float32)[:, :rows].T - r)))
                       for o, r in zip(outs, reference))
        if jax.default_backend() != "gpu":
            try:
                lowers_for_cuda(config, k, n)
            except Exception as exc:  # noqa: BLE001 - reported like a refusal on the GPU
                results.append({"shape": name, "k": k, "n": n, "rows": rows, "way": f"mgpu {config_name}",
                                "error": f"CUDA lowering: {type(exc).__name__}: {str(exc)[:200]}"})
                continue
        row(f"mgpu {config_name}", projections("mgpu", config), (x_t, weights_t), check)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, default=None, help="weights per call (default: the model's count)")
    p.add_argument("--ways", default="mgpu,splitk",
                   help="comma-separated ways to run beside xla (the reference, always run): mgpu, splitk, reduce")
    p.add_argument("--stacked", action="store_true",
                   help="the weights as one [layers, K, N] array, each layer read in place (the engine's way)")
    p.add_argument("--tiny", action="store_true", help="every shape cut to K=128, N=256 (CPU tests)")
    p.add_argument("--configs", default=None, help="comma-separated mgpu config names (default: all)")
    p.add_argument("--splitk-configs", default=",".join(SPLITK_RULES),
                   help=f"comma-separated splitk config names of {', '.join(SPLITK_RULES)} ('' for none)")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    configs = mgpu_configs()
    args.configs = {c: configs[c] for c in args.configs.split(",")} if args.configs else configs
    args.ways = [w for w in args.ways.split(",") if w]
    if set(args.ways) - {"mgpu", "splitk", "reduce"}:
        p.error(f"--ways takes mgpu, splitk and reduce, got {args.ways}")
    args.splitk_configs = [c for c in args.splitk_configs.split(",") if c]
    unknown = set(args.splitk_configs) - set(SPLITK_RULES)
    if unknown:
        p.error(f"unknown --splitk-configs {sorted(unknown)}: of {', '.join(SPLITK_RULES)}")
    results = []
    for name in args.shapes:
        k, n, layers = (128, 256, 2) if args.tiny else SHAPES[name]
        for rows in args.rows:
            # The mgpu way pads the rows to 64: its time does not depend on them, so it runs once.
            results += measure(name, k, n, args.layers or layers, rows, args,
                               with_mgpu="mgpu" in args.ways and rows == max(args.rows))
    print(f"{'shape':>12} {'rows':>4} {'way':>22} {'us':>8} {'kernel us':>9} {'GB/s':>7} {'of copy BW':>10} "
          f"{'max err':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['shape']:>12} {r['rows']:>4} {r['way']:>22}  {r['error']}")
            continue
        err = f"{r['max_abs_error']:.3g}" if "max_abs_error" in r else ""
        kernel = "-" if r["kernel_us"] is None else f"{r['kernel_us']:.1f}"
        c = r.get("config")
        tiling = f"  tn{c['tile_n']} tk{c['tile_k']} x{c['splits']} s{c['max_concurrent_steps']}" if c else ""
        print(f"{r['shape']:>12} {r['rows']:>4} {r['way']:>22} {r['us']:8.1f} {kernel:>9} {r['gb_per_s']:7.0f} "
              f"{r['copy_bw_share']:10.1%} {err:>8}{tiling}")
    if args.output_json:
        from mrv2_jax.bench.environment import describe_environment

        with open(args.output_json, "w") as f:
            json.dump({**describe_environment(), "settings": {k: v for k, v in vars(args).items() if k != "configs"},
                       "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
