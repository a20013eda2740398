"""A decoder layer's projections at batch 1 as four fused GEMV kernels, against XLA (issue 26).

Qwen3-0.6B's dense layer without its attention, 28 layers chained in one jitted call (unrolled, as
the engine's small buckets are), the residual stream h [1, 1024] carried through:

    x = rmsnorm(h) * g1;  qkv = x @ Wqkv;  a = qkv[:, :2048]     (a stands in for the attention's output)
    h = h + a @ Wo;  x = rmsnorm(h) * g2;  m = silu(x @ Wgate) * (x @ Wup);  h = h + m @ Wdown

Ways:
  xla_1row   XLA over [K, N] weights, one row (what a one-token product compiles to)
  xla_8row   the same with h padded to 8 rows (the engine's one-row buckets since fused.ONE_ROW_TOKENS:
             cuBLAS GEMMs instead of XLA's reductions)
  nk_1row    XLA over [N, K] weights (the engine's layout since session 45), one row: the products become
             reductions along contiguous rows of K
  nk_8row    the same at 8 rows (cuBLAS with the transposed operand)
  gemv       the engine's GEMV path (mrv2_jax/models/gemv_projections.py: pallas_kernels/gemv_triton over
             [N, K] weights), four kernels a layer: norm + qkv, o + residual, norm + gate/up + SwiGLU,
             down + residual; the `a` slice is the only other op
`--ways` keeps some of them.

Reported per way: the kernels' device time per layer (profiler), their launches per layer, the wall
time per call when calls run back to back (device-bound: the host queues ahead) per layer, and
the weights' GB/s at that wall time; the max error of h against the first way. On a CPU the
kernels run in their interpreter (--tiny: small shapes, 2 layers) and the wall time is one call's.

    python -m benchmarks.decode_layer_gemv --output-json decode_layer_gemv.json
"""

from __future__ import annotations

import argparse
import functools
import time

import mrv2_jax  # noqa: F401  (the engine's XLA flags)

# Qwen3-0.6B: hidden, q + k + v width, attention output width, intermediate.
QWEN3_06B = {"hidden": 1024, "qkv": 4096, "attn": 2048, "inter": 3072, "layers": 28}
TINY = {"hidden": 256, "qkv": 512, "attn": 256, "inter": 256, "layers": 2}
EPS = 1e-6


def make_weights(dims, seed=0):
    """Per layer, [K, N] weights (XLA's ways) and the same as [N, K] stacks (the kernels')."""
    import jax
    import jax.numpy as jnp

    d, q, a, i, layers = dims["hidden"], dims["qkv"], dims["attn"], dims["inter"], dims["layers"]
    keys = iter(jax.random.split(jax.random.key(seed), 8))

    def normal(shape, scale):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(jnp.bfloat16)

    nk = {"qkv": normal((layers, q, d), d**-0.5), "o": normal((layers, d, a), a**-0.5),
          "gate": normal((layers, i, d), d**-0.5), "up": normal((layers, i, d), d**-0.5),
          "down": normal((layers, d, i), i**-0.5),
          "g1": (1 + 0.1 * jax.random.normal(next(keys), (layers, d))).astype(jnp.bfloat16),
          "g2": (1 + 0.1 * jax.random.normal(next(keys), (layers, d))).astype(jnp.bfloat16)}
    kn = {name: [w[layer].T.copy() for layer in range(layers)] for name in ("qkv", "o", "down") for w in [nk[name]]}
    kn["gate_up"] = [jnp.concatenate([nk["gate"][layer].T, nk["up"][layer].T], axis=1) for layer in range(layers)]
    kn |= {"g1": list(nk["g1"]), "g2": list(nk["g2"])}
    nk["gate_up"] = jnp.concatenate([nk.pop("gate"), nk.pop("up")], axis=1)
    return kn, nk


def xla_layers(h, kn, *, rows):
    """The layers over per-layer [K, N] weights (the engine's layout before session 45), h padded to
    `rows` rows, with the models' RMSNorm."""
    import jax
    import jax.numpy as jnp

    from mrv2_jax.models.layers import rms_norm

    m = h.shape[0]
    h = jnp.pad(h, ((0, rows - m), (0, 0)))
    attn = kn["o"][0].shape[0]
    for layer in range(len(kn["qkv"])):
        qkv = rms_norm(h, kn["g1"][layer], EPS) @ kn["qkv"][layer]
        h = h + qkv[:, :attn] @ kn["o"][layer]
        gate, up = jnp.split(rms_norm(h, kn["g2"][layer], EPS) @ kn["gate_up"][layer], 2, axis=-1)
        h = h + (jax.nn.silu(gate) * up) @ kn["down"][layer]
    return h[:m]


def nk_layers(h, nk, *, rows):
    """The layers with the models' own math (mrv2_jax/models/layers.py) over per-layer [N, K] weights
    (gate and up stacked as [2I, K]), h padded to `rows` rows."""
    import jax.numpy as jnp

    from mrv2_jax.models.layers import gated_mlp, linear, rms_norm

    m = h.shape[0]
    h = jnp.pad(h, ((0, rows - m), (0, 0)))
    attn = nk["o"][0].shape[1]
    for layer in range(len(nk["qkv"])):
        qkv = linear(rms_norm(h, nk["g1"][layer], EPS), nk["qkv"][layer])
        h = h + linear(qkv[:, :attn], nk["o"][layer])
        h = h + gated_mlp(rms_norm(h, nk["g2"][layer], EPS), nk["gate_up"][layer], nk["down"][layer])
    return h[:m]


def gemv_layers(h, nk):
    """The layers through the engine's GEMV path (mrv2_jax/models/gemv_projections.py, its kernel
    configs): four gemv_triton kernels a layer over the [N, K] stacks read in place."""
    import numpy as np

    from mrv2_jax.models import gemv_projections as gp
    from mrv2_jax.models.layer_weight import LayerWeight

    attn = nk["o"].shape[2]
    for layer in range(nk["qkv"].shape[0]):
        # A numpy index, as the engine's unrolled layers have: an operand of the kernel, not compiled in.
        w = {name: LayerWeight(stack, np.int32(layer)) for name, stack in nk.items()}
        qkv = gp.norm_linear(h, w["g1"], w["qkv"], EPS)
        h = gp.linear_add(qkv[:, :attn], w["o"], h)
        h = gp.linear_add(gp.norm_swiglu(h, w["g2"], w["gate_up"], EPS), w["down"], h)
    return h


def back_to_back_seconds(fn, args, calls: int) -> float:
    """Wall seconds per call of `calls` calls queued back to back (the device stays busy)."""
    import jax

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes, 2 layers (CPU tests)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--ways", nargs="+", default=None, help="only these ways (the first is the error's reference)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mrv2_jax.bench.trace import profile_kernels

    dims = TINY if args.tiny else QWEN3_06B
    on_gpu = jax.default_backend() == "gpu"
    kn, nk = make_weights(dims)
    h = jax.random.normal(jax.random.key(1), (1, dims["hidden"]), jnp.bfloat16)
    kn_t = {name: [w.T.copy() if w.ndim == 2 else w for w in ws] for name, ws in kn.items()}
    weight_bytes = 2 * sum(w[0].size for name, w in kn.items() if name not in ("g1", "g2"))  # a layer's
    ways = {"xla_1row": (functools.partial(xla_layers, rows=1), kn),
            "xla_8row": (functools.partial(xla_layers, rows=8), kn),
            "nk_1row": (functools.partial(nk_layers, rows=1), kn_t),
            "nk_8row": (functools.partial(nk_layers, rows=8), kn_t),
            "gemv": (gemv_layers, nk)}
    ways = {way: ways[way] for way in args.ways or ways}
    layers = dims["layers"]
    reference, results = None, []
    # Each way's row is printed as soon as it is measured, so that a run cut short keeps what it had.
    print(f"{'way':>14} {'wall us/layer':>14} {'GB/s':>6} {'kernel us/layer':>16} {'launches/layer':>15} "
          f"{'max err':>8}", flush=True)
    for way, (fn, weights) in ways.items():
        call = jax.jit(fn)
        t0 = time.perf_counter()
        try:
            out = np.asarray(call(h, weights), np.float32)
        except Exception as exc:  # noqa: BLE001 - a way the GPU refuses is a result, reported
            results.append({"way": way, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(f"{way:>14}  {results[-1]['error']}", flush=True)
            continue
        reference = out if reference is None else reference
        # Without a GPU (the kernels interpreted) one call, its compile included, is figure enough.
        wall = (back_to_back_seconds(call, (h, weights), args.calls) if on_gpu else time.perf_counter() - t0) / layers
        kernels = profile_kernels(call, (h, weights), calls=5) if on_gpu else []
        entry = {"way": way, "wall_us_per_layer": wall * 1e6, "gb_per_s": weight_bytes / wall / 1e9,
                 "max_abs_error": float(np.abs(out - reference).max()),
                 "kernel_us_per_layer": sum(k["ms_per_step"] for k in kernels) * 1e3 / layers if kernels else None,
                 "launches_per_layer": sum(k["launches_per_step"] for k in kernels) / layers if kernels else None,
                 "kernels": [(k["kernel"], round(k["ms_per_step"] * 1e3 / layers, 2)) for k in kernels[:8]]}
        results.append(entry)
        kernel = "-" if entry["kernel_us_per_layer"] is None else f"{entry['kernel_us_per_layer']:.1f}"
        launches = "-" if entry["launches_per_layer"] is None else f"{entry['launches_per_layer']:.1f}"
        print(f"{way:>14} {entry['wall_us_per_layer']:14.1f} {entry['gb_per_s']:6.0f} {kernel:>16} {launches:>15} "
              f"{entry['max_abs_error']:8.3g}", flush=True)
    if args.output_json:
        from mrv2_jax.bench.environment import describe_environment, write_report

        write_report({**describe_environment(), "settings": vars(args), "dims": dims,
                      "weight_bytes_per_layer": weight_bytes, "results": results}, args.output_json)
    return results


if __name__ == "__main__":
    main()
