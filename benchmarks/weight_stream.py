"""How fast a Mosaic GPU kernel streams a batch-1 weight out of HBM, by tiling (issue 26).

At batch 1 a projection reads its `[N, K]` weight once and does one multiply-add an element, so its
speed is the speed at which its CTAs pull tiles through TMA into shared memory. This probe measures
that ceiling alone, per way of tiling: each CTA streams its share of the weight (a group of rows,
all of K or a `1 / ksplit` part of it) in boxes of `rows` rows by `kbox` 256-wide chunks of K (the
weight viewed as `[N, K / 256, 256]`, as a TMA box is at most 256 wide) through an `emit_pipeline`
of `stages` slots and touches one row of each tile (a checksum, so that every tile is waited for),
nothing else. Beside it, XLA's own row reduction of the same weight (`jnp.sum(w, axis=1)`), the
figure a kernel should at least match (docs/benchmarks.md says why the question came up).

Each way runs once per layer of a 28-layer `[L, N, K]` stack (larger than L2, so every byte comes
from HBM), 28 chained calls in one jitted program timed back to back: microseconds a call and GB/s.

    python -m benchmarks.weight_stream --output-json weight_stream.json
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import mrv2_jax  # noqa: F401  (the engine's XLA flags)

WIDTH = 256  # a tile's columns (the widest TMA box)
OUT_PER_CTA = 8  # a CTA stores its checksum 8 times (a TMA store moves at least 16 bytes)
# Qwen3-0.6B's batch-1 weights: (N, K).
SHAPES = {"o_proj": (1024, 2048), "gate_up_proj": (6144, 1024)}
TINY_SHAPES = {"tiny": (64, 512)}


def _stream_kernel(layer_gmem, w_gmem, out_gmem, *, rows, stages, ctas, ksplit, kbox):
    j = lax.axis_index("n")
    group, part = j // ksplit, j % ksplit  # the CTA's rows, and its part of K
    w = w_gmem.at[layer_gmem[0]]  # [N, K / 256, 256]
    n, num_chunks = w.shape[:2]
    boxes, kboxes = n // (ctas // ksplit) // rows, num_chunks // ksplit // kbox  # a CTA's boxes down N, along K
    layout = plgpu.Layout.WG_STRIDED((WIDTH,), vec_size=2)

    def step(_, w_smem, acc):
        for c in range(kbox):
            acc = acc + w_smem[0, c, :].astype(jnp.float32)
        plgpu.commit_smem()  # every thread's read is done before the pipeline refills the slot
        return acc

    acc = plgpu.emit_pipeline(
        step, grid=(boxes, kboxes), max_concurrent_steps=stages,
        in_specs=[plgpu.BlockSpec((rows, kbox, WIDTH), lambda i, c: (group * boxes + i, part * kboxes + c, 0))],
        init_carry=plgpu.layout_cast(jnp.zeros((WIDTH,), jnp.float32), layout))(w)

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((1, OUT_PER_CTA), jnp.float32))
    def _(o_smem):
        total = jnp.sum(acc)
        for r in range(OUT_PER_CTA):
            o_smem[0, r] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[:, pl.ds(j * OUT_PER_CTA, OUT_PER_CTA)])
        plgpu.wait_smem_to_gmem(0)


def stream(w, layer, *, rows: int, stages: int, ctas: int, ksplit: int = 1, kbox: int = 1, interpret=False):
    """Each CTA's checksum `[1, ctas * 8]`: the sum of the first row of each of its tiles (`rows` rows by
    `kbox * 256` columns) of `w[layer]` (`w [L, N, K]` bf16)."""
    n, k = w.shape[1:]
    if ctas % ksplit or n % (ctas // ksplit * rows) or k % (WIDTH * ksplit * kbox):
        raise ValueError(f"[N, K] = {(n, k)} does not tile into {ctas} CTAs of [{rows}, {kbox} x {WIDTH}] "
                         f"boxes with K split {ksplit} ways")
    num_steps = n // (ctas // ksplit) // rows * (k // WIDTH // ksplit // kbox)
    kernel = plgpu.kernel(
        functools.partial(_stream_kernel, rows=rows, stages=min(stages, num_steps), ctas=ctas, ksplit=ksplit,
                          kbox=kbox),
        out_type=jax.ShapeDtypeStruct((1, ctas * OUT_PER_CTA), jnp.float32), grid=(ctas,), grid_names=("n",),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return kernel(jnp.asarray(layer, jnp.int32).reshape(1), w.reshape(*w.shape[:2], k // WIDTH, WIDTH))


def stream_reference(w, layer, *, rows: int, ctas: int, ksplit: int = 1, kbox: int = 1) -> np.ndarray:
    """What `stream` returns, in numpy (a box's first row over all its chunks: `kbox` changes no sum)."""
    del kbox
    w = np.asarray(w[layer], np.float64)
    per_group, per_part = w.shape[0] // (ctas // ksplit), w.shape[1] // ksplit
    sums = [w[g * per_group:(g + 1) * per_group:rows, p * per_part:(p + 1) * per_part].sum()
            for g in range(ctas // ksplit) for p in range(ksplit)]
    return np.repeat(np.asarray(sums), OUT_PER_CTA)[None]


def over_layers(fn, w):
    """`fn(w, layer)` once per layer, each call after the one before (a scan XLA unrolls)."""
    def body(carry, layer):
        out = fn(w, layer)
        return carry + out[0, 0].astype(jnp.float32), None
    return lax.scan(body, jnp.float32(0), jnp.arange(w.shape[0]), unroll=True)[0]


def xla_row_sums(w, layer):
    return jnp.sum(w[layer], axis=1, dtype=jnp.float32)[None]


SMEM_BUDGET = 160 * 1024  # bytes of pipeline slots a CTA may take


def ways(n: int, k: int, tiny: bool) -> dict:
    """Name -> (fn(w, layer), tiling) of every tiling that divides [N, K] and fits shared memory; the
    boxes of several chunks last (a way that hangs leaves the others measured)."""
    found = {"xla row sums": (xla_row_sums, None)}
    grid = ([(1, 8, 2, 4, 1), (1, 8, 2, 4, 2), (2, 8, 2, 4, 1)] if tiny else
            itertools.product((1, 4), (8, 32, 64), (2, 4, 8), (128, 256), (1, 4)))
    for kbox, rows, stages, ctas, ksplit in grid:
        fits = rows * kbox * WIDTH * 2 * stages <= SMEM_BUDGET
        if fits and n % (ctas // ksplit * rows) == 0 and k % (WIDTH * ksplit * kbox) == 0:
            tiling = dict(rows=rows, ctas=ctas, ksplit=ksplit, kbox=kbox)
            found[f"tma [{rows:2}, {kbox} x 256] x {stages} stages, {ctas} CTAs, K / {ksplit}"] = (
                functools.partial(stream, stages=stages, interpret=tiny, **tiling), tiling)
    return found


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="one small shape, 2 layers, in the interpreter (CPU tests)")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from benchmarks.decode_layer_gemv import back_to_back_seconds

    layers = 2 if args.tiny else 28
    results = []

    def report():
        if args.output_json:
            from mrv2_jax.bench.environment import describe_environment, write_report

            write_report({**describe_environment(), "settings": vars(args), "results": results}, args.output_json)

    print(f"{'weight':>13} {'way':56} {'us/call':>8} {'GB/s':>6}", flush=True)
    for name, (n, k) in (TINY_SHAPES if args.tiny else SHAPES).items():
        w = (jax.random.normal(jax.random.key(0), (layers, n, k), jnp.float32) * 0.1).astype(jnp.bfloat16)
        for way, (fn, tiling) in ways(n, k, args.tiny).items():
            entry = {"weight": name, "shape": [n, k], "way": way}
            try:
                if tiling is not None:  # each CTA's tiles: checked against numpy before timing
                    np.testing.assert_allclose(np.asarray(jax.jit(fn)(w, 1)), stream_reference(w, 1, **tiling),
                                               rtol=1e-3, atol=1e-2)
                call = jax.jit(functools.partial(over_layers, fn))
                seconds = None if args.tiny else min(back_to_back_seconds(call, (w,), args.calls)
                                                     for _ in range(3)) / layers
            except Exception as exc:  # noqa: BLE001 - a tiling the GPU refuses is a result, reported
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"{name:>13} {way:56} {entry['error']}", flush=True)
                results.append(entry)
                report()
                continue
            entry["us_per_call"] = None if seconds is None else seconds * 1e6
            entry["gb_per_s"] = None if seconds is None else n * k * 2 / seconds / 1e9
            results.append(entry)
            us = "-" if seconds is None else f"{seconds * 1e6:.2f}"
            gbs = "-" if seconds is None else f"{entry['gb_per_s']:.0f}"
            print(f"{name:>13} {way:56} {us:>8} {gbs:>6}", flush=True)
            report()  # after every way: a run cut short keeps what it measured
    return results


if __name__ == "__main__":
    main()
