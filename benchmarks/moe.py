"""Microbenchmark: the routed experts of one MoE layer, by backend, at Qwen3-30B-A3B shapes.

    python -m benchmarks.moe --output-json $OUT/moe.json [--sweep]

Shapes: E=128 experts, top-8, hidden 2048, moe_intermediate 768, bf16, tokens 256 (a decode
batch) and 4096 (a prefill chunk); routing from random logits (about uniform over experts).
Cases, each one jitted call timed to completion (median of --runs):

  layer/<backend>   the whole routed-expert MLP (`mrv2_jax.models.moe.routed_experts`):
                    sort by expert, gate_up GEMM, SwiGLU, down GEMM, un-permute + weights.
                    backends: pallas (our grouped GEMM, Triton), mgpu (our grouped GEMM on
                    Mosaic GPU: TMA + wgmma, the weight streamed once per row tile), ragged_dot
                    (jax.lax.ragged_dot), dense (every token through every expert), pallas_fp8
                    and mgpu_fp8 (FP8 weights with 128x128 block scales, dequantised in the kernel)
  gemm/<backend>    the gate_up grouped GEMM alone ([T*8, 2048] x [128, 2048, 1536]): pallas
                    always, mgpu and ragged_dot when among --backends
  sweep/...         (--sweep) the gate_up GEMM with other kernel tilings

Floors: FLOPs of the routed work only (6 * T * k * H * I for the layer) at 790 TFLOP/s bf16,
and the bytes of the weights of the experts that got tokens at 4.3 TB/s; `floor_ms` is the
larger. A case that fails (e.g. out of memory) records its error and the run goes on.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import time_calls
from mrv2_jax.bench.environment import describe_environment
from mrv2_jax.models.moe import routed_experts, softmax_topk_router
from pallas_kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from pallas_kernels.grouped_gemm_mgpu import grouped_gemm_mgpu

PEAK_FLOPS, PEAK_BW = 790e12, 4.3e12
SWEEP = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (16, 128, 64, 4, 3), (32, 128, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
    (64, 128, 128, 8, 3), (128, 128, 32, 4, 4), (64, 64, 64, 4, 4), (128, 256, 64, 8, 3),
]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def make_inputs(tokens: int, E, TOP_K, H, I, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (tokens, H), jnp.bfloat16)
    weights, ids = softmax_topk_router(jax.random.normal(keys[1], (tokens, E)), TOP_K, True)
    gate_up = (0.02 * jax.random.normal(keys[2], (E, H, 2 * I))).astype(jnp.bfloat16)
    down = (0.02 * jax.random.normal(keys[3], (E, I, H))).astype(jnp.bfloat16)
    return x, weights, ids, gate_up, down


@jax.jit
def quantize_fp8(w):
    """bf16 [E, K, N] -> (float8 [E, K, N], f32 scales [E, K/128, N/128]); device-side."""
    e, k, n = w.shape
    blocks = w.astype(jnp.float32).reshape(e, k // 128, 128, n // 128, 128)
    scale = jnp.max(jnp.abs(blocks), axis=(2, 4)) / 448.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = (blocks / scale[:, :, None, :, None]).reshape(e, k, n).astype(jnp.float8_e4m3fn)
    return q, scale


def floors(tokens: int, ids, layer: bool, TOP_K, H, I) -> dict:
    rows = tokens * TOP_K
    flops = (6 if layer else 4) * rows * H * I
    touched = int(np.unique(np.asarray(ids)).size)
    weight_bytes = touched * (3 if layer else 2) * H * I * 2
    return {"gflop": flops / 1e9, "experts_touched": touched, "weight_mb": weight_bytes / 1e6,
            "floor_ms": 1e3 * max(flops / PEAK_FLOPS, weight_bytes / PEAK_BW)}


def _time(fn, args, opts) -> dict:
    try:
        samples = time_calls(fn, args, runs=opts.runs, warmup=opts.warmup)
    except Exception as e:  # noqa: BLE001 - record e.g. an OOM of the dense arms and go on
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"ms": 1e3 * statistics.median(samples), "ms_min": 1e3 * min(samples)}


def run_cases(tokens: int, opts) -> list[dict]:
    E, TOP_K, H, I = opts.experts, opts.top_k, opts.hidden, opts.moe_intermediate
    x, weights, ids, gate_up, down = make_inputs(tokens, E, TOP_K, H, I)
    results = []
    interpret = jax.default_backend() != "gpu"  # CPU: a smoke test in the Pallas interpreter
    gemm = functools.partial(grouped_gemm, interpret=interpret)

    def record(name, fn, args, layer):
        r = {"case": name, "tokens": tokens, **floors(tokens, ids, layer, TOP_K, H, I),
             **_time(jax.jit(fn), args, opts)}
        if "ms" in r:
            r["tflops"] = r["gflop"] / r["ms"]
            r["floor_fraction"] = r["floor_ms"] / r["ms"]
        results.append(r)
        print(_row(r), flush=True)

    for backend in opts.backends:
        if backend.endswith("_fp8"):
            gu8, gu_s = quantize_fp8(gate_up)
            d8, d_s = quantize_fp8(down)
            fn = functools.partial(_layer_fp8, backend=backend.removesuffix("_fp8"))
            record(f"layer/{backend}", fn, (x, weights, ids, gu8, d8, gu_s, d_s), True)
            continue
        fn = functools.partial(routed_experts, backend=backend)
        record(f"layer/{backend}", fn, (x, weights, ids, gate_up, down), True)

    # The gate_up GEMM alone, on rows already sorted by expert.
    lhs, sizes = _sorted_rows(x, ids, E)
    record("gemm/pallas", gemm, (lhs, gate_up, sizes), False)
    if "mgpu" in opts.backends:
        record("gemm/mgpu", functools.partial(grouped_gemm_mgpu, interpret=interpret), (lhs, gate_up, sizes), False)
    if "ragged_dot" in opts.backends:
        record("gemm/ragged_dot", grouped_gemm_reference, (lhs, gate_up, sizes), False)
    if opts.sweep:
        for bm, bn, bk, warps, stages in SWEEP:
            fn = functools.partial(gemm, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                   num_stages=stages)
            record(f"sweep/m{bm}_n{bn}_k{bk}_w{warps}_s{stages}", fn, (lhs, gate_up, sizes), False)
    return results


@functools.partial(jax.jit, static_argnums=2)
def _sorted_rows(x, ids, num_experts: int):
    """The rows of x each token's experts read, sorted by expert, and each expert's row count."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return x[order // ids.shape[1]], jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)


def _layer_fp8(x, weights, ids, gu8, d8, gu_s, d_s, backend):
    return routed_experts(x, weights, ids, gu8, d8, backend=backend, gate_up_scale=gu_s, down_scale=d_s)


def _row(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:34s} {r['tokens']:5d}  error: {r['error'][:80]}"
    return (f"{r['case']:34s} {r['tokens']:5d} {r['ms']:9.3f} {r['floor_ms']:9.3f} "
            f"{100 * r['floor_fraction']:6.1f}% {r['tflops']:8.1f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--backends", nargs="+", default=["pallas", "mgpu", "ragged_dot", "dense", "pallas_fp8",
                                                          "mgpu_fp8"])
    ap.add_argument("--sweep", action="store_true", help="also time other tilings of the kernel")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--output-json")
    opts = ap.parse_args(argv)
    env = describe_environment()
    print(json.dumps(env))
    print(f"{'case':34s} {'T':>5s} {'ms':>9s} {'floor ms':>9s} {'floor%':>7s} {'TFLOP/s':>8s}")
    results = []
    for tokens in opts.tokens:
        results += run_cases(tokens, opts)
    speedups = {}
    for tokens in opts.tokens:
        by = {r["case"]: r.get("ms") for r in results if r["tokens"] == tokens}
        for a, b in (("layer/pallas", "layer/ragged_dot"), ("gemm/pallas", "gemm/ragged_dot"),
                     ("layer/pallas", "layer/dense"), ("layer/mgpu", "layer/pallas"), ("gemm/mgpu", "gemm/pallas"),
                     ("layer/mgpu_fp8", "layer/pallas_fp8")):
            if by.get(a) and by.get(b):
                speedups[f"{b} / {a} @ {tokens}"] = by[b] / by[a]
    for k, v in speedups.items():
        print(f"speedup {k}: {v:.2f}x")
    shapes = {"experts": opts.experts, "top_k": opts.top_k, "hidden": opts.hidden,
              "moe_intermediate": opts.moe_intermediate, "dtype": "bfloat16"}
    out = {**env, "shapes": shapes, "results": results, "speedups": speedups}
    if opts.output_json:
        with open(opts.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
