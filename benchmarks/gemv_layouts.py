"""Would decode's projections stream faster from an `[N, K]` weight layout (issue 26)?

The engine stores a projection as `[K, N]` (`y = x @ w`). A GEMV over that layout splits N into
narrow column blocks whose rows are a few dozen bytes apart by `N * 2`, or splits K and must sum
partials; over `[N, K]` (the Hugging Face layout) each output column is one contiguous K-long row,
so N splits finely with every load a full line. This benchmark asks whether that is worth a layout
change, at Qwen3-0.6B's projection shapes and 1 or 8 rows, before any engine code changes:

  xla_kn     x @ w[l], w [L, K, N]: the engine today (cuBLAS at 8 rows; XLA's reductions at 1)
  xla_nk     the same product from w^T [L, N, K] (cuBLAS's transposed operand)
  tdot_nk    a Pallas (Triton) kernel over w^T: program j owns `block_n` rows of w^T (outputs), walks
             K in a pipelined loop (`num_stages`) and multiplies on the tensor cores: w^T tile
             [block_n, block_k] @ x^T tile [block_k, 16] (rows padded to 16)
  tfma_nk    one row only: the same walk, multiplied on the CUDA cores ([block_n, block_k] f32
             accumulator summed over K at the end)
  mfma_nk    one row only, on Pallas's Mosaic GPU backend (pallas_kernels/gemv_mgpu.py): CTA j
             owns `block_n` rows of w^T and all of K, streamed through shared memory with TMA,
             multiplied on the CUDA cores; N = 1024 makes 64-128 CTAs without splitting K

Each call runs the product for each of 28 stacked layers (weights stream from HBM); reported per
way: the kernels' device time per projection (profiler; wall time without a GPU), GB/s of weight and
the max error against xla_kn. On a CPU (`--tiny`) the kernels run in Pallas's interpreter.

    python -m benchmarks.gemv_layouts --rows 1 8 --output-json gemv_layouts.json
"""

from __future__ import annotations

import argparse
import functools
import statistics

import mrv2_jax  # noqa: F401  (the engine's XLA flags)
from benchmarks.skinny_gemm import SHAPES as _PROJECTIONS

LAYERS = 28
# Qwen3-0.6B's layer projections: name -> (K, N).
SHAPES = {name: (k, n) for name, (k, n, _) in _PROJECTIONS.items() if name != "lm_head"}
# (block_n, block_k, num_warps, num_stages) per kernel way (mfma_nk: block_k and warps are fixed).
CONFIGS = {"tdot_nk": [(16, 256, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (16, 512, 4, 3)],
           "tfma_nk": [(8, 512, 4, 3), (16, 256, 4, 4), (8, 1024, 8, 2), (32, 256, 8, 3)],
           "mfma_nk": [(8, 256, 4, 4), (8, 256, 4, 8), (16, 256, 4, 4), (16, 256, 4, 8)]}


def _nk_kernel(layer_ref, x_ref, w_ref, out_ref, *, rows, n, k_dim, block_n, block_k, fma):
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    layer = layer_ref[0]
    r = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    r_ok = r < n
    m = jnp.arange(16, dtype=jnp.int32)
    m_ok = m < rows

    def step(i, acc):
        k = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        w = pltriton.load(w_ref.at[(layer * n + r)[:, None], k[None, :]], mask=r_ok[:, None], other=0)
        if fma:
            xk = pltriton.load(x_ref.at[0, k[None, :]])
            return acc + w.astype(jnp.float32) * xk.astype(jnp.float32)
        xk = pltriton.load(x_ref.at[m[:, None], k[None, :]], mask=m_ok[:, None], other=0)
        return acc + jnp.dot(w, xk.T, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, k_dim // block_k, step,
                        jnp.zeros((block_n, block_k if fma else 16), jnp.float32))
    if fma:
        pltriton.store(out_ref.at[0, r], jnp.sum(acc, axis=1).astype(out_ref.dtype), mask=r_ok)
    else:
        pltriton.store(out_ref.at[m[None, :], r[:, None]], acc.astype(out_ref.dtype),
                       mask=r_ok[:, None] & m_ok[None, :])


def gemv_nk(x, wt, layer, *, block_n, block_k, num_warps, num_stages, fma, interpret):
    """x [M, K] @ wt[layer].T for wt [L, N, K] (M <= 16; M == 1 with fma)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    rows, k_dim = x.shape
    num_layers, n, _ = wt.shape
    if k_dim % block_k or rows > 16 or (fma and rows != 1):
        raise ValueError(f"gemv_nk: K={k_dim} % block_k={block_k}, rows={rows}, fma={fma}")
    kernel = functools.partial(_nk_kernel, rows=rows, n=n, k_dim=k_dim, block_n=block_n, block_k=block_k, fma=fma)
    return pl.pallas_call(kernel, grid=(pl.cdiv(n, block_n),), out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
                          interpret=interpret, name="gemv_nk",
                          compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                          )(jnp.asarray(layer, jnp.int32).reshape(1), x, wt.reshape(num_layers * n, k_dim))


def gemv_nk_mgpu(x, wt, layer, *, block_n, num_stages, interpret, **_):
    """x [1, K] @ wt[layer].T on Mosaic GPU: pallas_kernels.gemv_mgpu with nothing before or after."""
    from pallas_kernels.gemv_mgpu import GemvConfig, gemv

    return gemv(x, wt, layer=layer, config=GemvConfig(block_n=block_n, num_stages=num_stages), interpret=interpret)


def _over_layers(fn):
    import jax

    return jax.jit(lambda x, w: [fn(x, w, layer) for layer in range(w.shape[0])])


def measure(name: str, rows: int, args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.timing import time_calls
    from mrv2_jax.bench.trace import profile_kernels

    k, n = (256, 256) if args.tiny else SHAPES[name]
    layers = 2 if args.tiny else LAYERS
    keys = jax.random.split(jax.random.key(0), 2)
    w = (jax.random.normal(keys[0], (layers, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    wt = jnp.swapaxes(w, 1, 2).copy()  # [L, N, K]
    x = jax.random.normal(keys[1], (rows, k), jnp.bfloat16)
    on_gpu = jax.default_backend() == "gpu"
    ways = {"xla_kn": (lambda x, w, l: x @ w[l], w),
            "xla_nk": (lambda x, w, l: jnp.dot(x, w[l].T), wt)}
    for way in ("tdot_nk", "tfma_nk", "mfma_nk"):
        if way != "tdot_nk" and rows != 1:
            continue
        kernel = gemv_nk_mgpu if way == "mfma_nk" else functools.partial(gemv_nk, fma=way == "tfma_nk")
        for cfg in CONFIGS[way][: args.max_configs]:
            bn, bk, warps, stages = cfg
            bk = min(bk, k)
            ways[f"{way} {bn}/{bk}/{warps}/{stages}"] = (functools.partial(
                kernel, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, interpret=not on_gpu), wt)
    reference = None
    results = []
    for way, (fn, weights) in ways.items():
        entry = {"shape": name, "k": k, "n": n, "rows": rows, "way": way}
        call = _over_layers(fn)
        try:
            outs = [np.asarray(o, np.float32) for o in call(x, weights)]
            reference = outs if reference is None else reference
            entry["max_abs_error"] = max(float(np.abs(o - r).max()) for o, r in zip(outs, reference))
            wall = statistics.median(time_calls(call, (x, weights), args.runs, args.warmup)) / layers
        except Exception as exc:  # noqa: BLE001 - a config the compiler refuses is a result, reported
            results.append(entry | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        kernels = profile_kernels(call, (x, weights), calls=5) if on_gpu else []
        seconds = sum(kn["ms_per_step"] for kn in kernels) / 1e3 / layers if kernels else wall
        results.append(entry | {"us": seconds * 1e6, "wall_us": wall * 1e6, "gb_per_s": k * n * 2 / seconds / 1e9,
                                "kernels": [kn["kernel"] for kn in kernels[:3]]})
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--max-configs", type=int, default=None, help="the first N configs per kernel way")
    p.add_argument("--tiny", action="store_true", help="K=256, N=256, 2 layers (CPU tests)")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    results = [r for name in args.shapes for rows in args.rows for r in measure(name, rows, args)]
    print(f"{'shape':>8} {'rows':>4} {'way':>24} {'us':>7} {'wall us':>8} {'GB/s':>6} {'max err':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['shape']:>8} {r['rows']:>4} {r['way']:>24}  {r['error']}")
            continue
        print(f"{r['shape']:>8} {r['rows']:>4} {r['way']:>24} {r['us']:7.1f} {r['wall_us']:8.1f} "
              f"{r['gb_per_s']:6.0f} {r['max_abs_error']:8.3g}")
    if args.output_json:
        from mrv2_jax.bench.environment import describe_environment, write_report

        write_report({**describe_environment(), "settings": vars(args), "results": results}, args.output_json)
    return results


if __name__ == "__main__":
    main()
