"""A decode projection of a few rows, by the form XLA is given (issue 26).

`x [R, K] @ w.T` for a `[N, K]` weight at R = 1, 8 and 32 rows (`--rows`), as:
- `dot`: the einsum the layers use (cuBLAS, or XLA's own GEMM emitter);
- `reduce`: `sum(w * x, axis=K)` in float32, which XLA emits as a row reduction with the product
  fused into it: output row-major `[R, N]` (each of the R output rows streams the weight again) and
  weight-major `[N, R]` (each weight row's R sums side by side, then transposed);
- the GEMV kernel of the engine's one-row bucket (pallas_kernels/gemv_triton.py; a few rows: one
  accumulator a row), by tile config (reading the stacked weight in place);
- `triton engine`: the engine's config for the projection (models/gemv_projections.py), and at one
  row the same with each layer a Python int compiled into its kernel (no index load first).
`--forms` keeps the forms whose names contain one of its words.
Each runs once per layer of a 28-layer `[L, N, K]` stack (larger than L2, so the weight comes from
HBM), 28 calls in one jitted program timed back to back, and is checked against numpy first. The calls
share x and depend on nothing but their layer, unlike the engine's chain of projections: past one row
the figures did not carry over to the engine (docs/benchmarks.md, session 52), where
benchmarks.decode_layer_gemv (a dependent chain) and the engine's own benchmarks decide.

    python -m benchmarks.projection_forms --output-json projection_forms.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import mrv2_jax  # noqa: F401  (the engine's XLA flags)
from mrv2_jax.models import gemv_projections
from pallas_kernels import gemv_triton

# Qwen3-0.6B's decode projections: (N, K).
SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072)}
TINY_SHAPES = {"tiny": (64, 512)}


def dot(x, w):
    return jnp.einsum("ri,oi->ro", x, w)


def reduce_row_major(x, w):
    return jnp.sum(w.astype(jnp.float32)[None] * x.astype(jnp.float32)[:, None, :], axis=-1).astype(x.dtype)


def reduce_weight_major(x, w):
    return jnp.sum(w.astype(jnp.float32)[:, None, :] * x.astype(jnp.float32)[None], axis=-1).T.astype(x.dtype)


def triton_gemv(x, stack, layer, *, config, interpret):
    """The kernel reads layer `layer` of the stack in place (given a slice, XLA would copy it first)."""
    return gemv_triton.gemv(x, stack, layer=layer, config=config, interpret=interpret)


def of_layer(form):
    """An XLA form as a function of the stack and a layer index."""
    return lambda x, stack, layer: form(x, stack[layer])


def over_layers(form, x, w):
    """`form(x, w, layer)` once per layer, each call after the one before (a scan XLA unrolls)."""
    def body(carry, layer):
        return carry + form(x, w, layer)[0, 0].astype(jnp.float32), None
    # numpy indices, as the decoder's: unrolled, each folds to a literal (an iota would cost a slice kernel each)
    return lax.scan(body, jnp.float32(0), np.arange(w.shape[0], dtype=np.int32), unroll=True)[0]


def over_static_layers(form, x, w):
    """The same with each layer a Python int (a kernel that takes one compiles it in)."""
    total = jnp.float32(0)
    for layer in range(w.shape[0]):
        total = total + form(x, w, layer)[0, 0].astype(jnp.float32)
    return total


def forms(rows: int, tiny: bool) -> dict:
    """Name -> form(x, stack, layer) of every form at `rows` rows (tiny: one config a kernel)."""
    found = {"dot": of_layer(dot), "reduce [R, N]": of_layer(reduce_row_major),
             "reduce [N, R]": of_layer(reduce_weight_major)}
    if rows <= gemv_triton.MAX_ROWS:
        sweep = {1: ((1, 2, 4), (512, 1024), (8,)), 8: ((1, 2), (512, 1024), (4, 8))}.get(
            rows, ((1,), (256, 512), (4, 8)))
        for block_n, block_k, warps in [(8, 256, 4)] if tiny else itertools.product(*sweep):
            found[f"triton {block_n}x{block_k} w{warps}"] = functools.partial(
                triton_gemv, config=gemv_triton.GemvConfig(block_n, block_k, warps), interpret=tiny)
        found[ENGINE] = engine_kernel(tiny)
    if rows == 1:  # the same with the layer compiled into each kernel (what the index's load costs)
        found[STATIC_LAYER] = engine_kernel(tiny)
    return found


ENGINE = "triton engine"
STATIC_LAYER = "triton engine, static layer"  # the form called with Python-int layers


def engine_kernel(tiny: bool):
    """The GEMV kernel with the engine's config for the projection, as a form (tiny: a wide shape's config
    with K in 256-wide chunks)."""
    def form(x, stack, layer):
        config = gemv_projections.gemv_config(*((4096, 1024) if tiny else stack.shape[1:]))
        if tiny:
            config = dataclasses.replace(config, block_k=min(config.block_k, 256))
        return triton_gemv(x, stack, layer, config=config, interpret=tiny)
    return form


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="one small shape, 2 layers, no timing (CPU tests)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--forms", nargs="+", default=None, help="only the forms whose names contain one of these")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from benchmarks.decode_layer_gemv import back_to_back_seconds

    layers = 2 if args.tiny else 28
    results = []
    print(f"{'weight':>13} {'rows':>4} {'form':28} {'us/call':>8} {'GB/s':>6}", flush=True)
    for name, (n, k) in (TINY_SHAPES if args.tiny else SHAPES).items():
        w = (jax.random.normal(jax.random.key(0), (layers, n, k), jnp.float32) * 0.1).astype(jnp.bfloat16)
        for rows in args.rows:
            x = jax.random.normal(jax.random.key(1), (rows, k), jnp.float32).astype(jnp.bfloat16)
            want = np.asarray(x, np.float32) @ np.asarray(w[1], np.float32).T
            for form_name, form in forms(rows, args.tiny).items():
                if args.forms and not any(word in form_name for word in args.forms):
                    continue
                static = form_name == STATIC_LAYER
                entry = {"weight": name, "shape": [n, k], "rows": rows, "form": form_name}
                try:
                    check = jax.jit(lambda x, w, form=form: form(x, w, 1)) if static else jax.jit(form)
                    got = np.asarray(check(x, w) if static else check(x, w, 1), np.float32)
                    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
                    seconds = None
                    if not args.tiny:
                        call = jax.jit(functools.partial(over_static_layers if static else over_layers, form))
                        seconds = min(back_to_back_seconds(call, (x, w), args.calls) for _ in range(3)) / layers
                except Exception as exc:  # noqa: BLE001 - a config the GPU refuses (or gets wrong) is a result
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    results.append(entry)
                    print(f"{name:>13} {rows:>4} {form_name:28} {entry['error'][:120]}", flush=True)
                    continue
                entry |= {"us_per_call": None if seconds is None else seconds * 1e6,
                          "gb_per_s": None if seconds is None else n * k * 2 / seconds / 1e9}
                results.append(entry)
                us = "-" if seconds is None else f"{seconds * 1e6:.2f}"
                gbs = "-" if seconds is None else f"{entry['gb_per_s']:.0f}"
                print(f"{name:>13} {rows:>4} {form_name:28} {us:>8} {gbs:>6}", flush=True)
    if args.output_json:
        from mrv2_jax.bench.environment import describe_environment, write_report

        write_report({**describe_environment(), "settings": vars(args), "results": results}, args.output_json)
    return results


if __name__ == "__main__":
    main()
