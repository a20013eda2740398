"""The one-row GEMV kernel (pallas_kernels/gemv_mgpu.py) by tile config, per projection of Qwen3-0.6B
(issue 26).

Each projection as the engine runs it (norm + qkv, o + residual, norm + gate/up + SwiGLU,
down + residual) over a 28-layer `[L, N, K]` stack: one jitted call makes 28 kernel calls, one per
layer (the stack is larger than the GPU's L2, so every weight comes from HBM), and is timed back to
back. Per config (`block_n` weight rows a CTA, `num_stages` tiles in flight, `kbox` 256-wide chunks of K a
tile): microseconds per kernel
and the weight's GB/s. The engine's choice (models/gemv_projections.gemv_config) is marked.

    python -m benchmarks.gemv_configs --output-json gemv_configs.json
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax.numpy as jnp

import mrv2_jax  # noqa: F401  (the engine's XLA flags)

# Qwen3-0.6B: (K, N, norm before, epilogue) a projection.
PROJECTIONS = {"qkv_proj": (1024, 4096, True, None), "o_proj": (2048, 1024, False, "residual"),
               "gate_up_proj": (1024, 6144, True, "swiglu"), "down_proj": (3072, 1024, False, "residual")}
TINY = {"qkv_proj": (512, 64, True, None), "gate_up_proj": (256, 64, True, "swiglu")}


def calls_over_layers(x, w, g, r, *, layers, norm, epilogue, config, interpret):
    """The kernel once per layer of the stack, `[layers, 1, N]`: a scan over a traced layer index that XLA
    unrolls, as the engine's small buckets do, so that the kernel is lowered once, not once a layer."""
    from jax import lax

    from pallas_kernels.gemv_mgpu import gemv

    fn = functools.partial(gemv, norm_weight=g if norm else None, epilogue=epilogue,
                           residual=r if epilogue == "residual" else None, config=config, interpret=interpret)
    return lax.scan(lambda _, layer: (None, fn(x, w, layer=layer)), None, jnp.arange(layers), unroll=True)[1]


def print_row(e: dict) -> None:
    """One config's line, printed as soon as it is measured (a run cut short keeps what it printed)."""
    mark = " <- engine" if e["engine"] else ""
    if "error" in e:
        print(f"{e['projection']:>13} {e['block_n']:7} {e['num_stages']:6} {e['kbox']:4}  {e['error']}{mark}",
              flush=True)
        return
    us = "-" if e["us_per_kernel"] is None else f"{e['us_per_kernel']:.2f}"
    gbs = "-" if e["gb_per_s"] is None else f"{e['gb_per_s']:.0f}"
    print(f"{e['projection']:>13} {e['block_n']:7} {e['num_stages']:6} {e['kbox']:4} {us:>9} {gbs:>6} "
          f"{e['max_abs_error']:8.3g}{mark}", flush=True)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes, 2 layers, two configs (CPU tests)")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    import jax
    import numpy as np

    from benchmarks.decode_layer_gemv import back_to_back_seconds
    from benchmarks.weight_stream import SMEM_BUDGET
    from mrv2_jax.models.gemv_projections import gemv_config
    from pallas_kernels.gemv_mgpu import BLOCK_K, GemvConfig, gemv_reference

    on_gpu = jax.default_backend() == "gpu"
    layers = 2 if args.tiny else 28
    projections = TINY if args.tiny else PROJECTIONS
    results = []
    print(f"{'projection':>13} {'block_n':>7} {'stages':>6} {'kbox':>4} {'us/kernel':>9} {'GB/s':>6} {'max err':>8}",
          flush=True)
    for name, (k, n, norm, epilogue) in projections.items():
        keys = jax.random.split(jax.random.key(len(name)), 4)
        x = jax.random.normal(keys[0], (1, k), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (layers, n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        g = (1 + 0.1 * jax.random.normal(keys[2], (layers, k))).astype(jnp.bfloat16)
        r = jax.random.normal(keys[3], (1, n), jnp.bfloat16)
        expected = np.asarray(gemv_reference(x, w, layer=layers - 1, norm_weight=g if norm else None,
                                             epilogue=epilogue, residual=r if epilogue == "residual" else None),
                              np.float32)
        chosen = gemv_config(n, epilogue)
        sizes = (16, 32) if args.tiny else ((16, 32) if epilogue == "swiglu" else (8, 16, 32))
        stages = (2,) if args.tiny else (2, 4, 8)
        kboxes = [b for b in ((1, 2) if args.tiny else (1, 4)) if k % (BLOCK_K * b) == 0]
        for block_n, num_stages, kbox in itertools.product(sizes, stages, kboxes):
            if block_n * kbox * BLOCK_K * 2 * num_stages > SMEM_BUDGET:  # bf16 tiles in flight
                continue
            config = GemvConfig(block_n=block_n, num_stages=num_stages, kbox=kbox)
            call = jax.jit(functools.partial(calls_over_layers, layers=layers, norm=norm, epilogue=epilogue,
                                             config=config, interpret=not on_gpu))
            entry = {"projection": name, "block_n": block_n, "num_stages": num_stages, "kbox": kbox,
                     "engine": config == chosen}
            try:
                out = np.asarray(call(x, w, g, r)[-1], np.float32)  # the last layer's
            except Exception as exc:  # noqa: BLE001 - a config the GPU refuses is a result, reported
                results.append(entry | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                print_row(results[-1])
                continue
            seconds = back_to_back_seconds(call, (x, w, g, r), args.calls) / layers if on_gpu else None
            results.append(entry | {
                "us_per_kernel": None if seconds is None else seconds * 1e6,
                "gb_per_s": None if seconds is None else n * k * 2 / seconds / 1e9,
                "max_abs_error": float(np.abs(out - expected).max())})
            print_row(results[-1])
    if args.output_json:
        from mrv2_jax.bench.environment import describe_environment, write_report

        write_report({**describe_environment(), "settings": vars(args), "layers": layers, "results": results},
                     args.output_json)
    return results


if __name__ == "__main__":
    main()
