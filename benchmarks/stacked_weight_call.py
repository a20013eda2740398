"""What a step's GEMMs over stacked per-layer weights cost the host per call, by how each layer's
weights reach cuBLAS. No model: a 28-layer chain of the Qwen3-0.6B projections' shapes (qkv, o,
gate_up, down; weights [layer, out, in] in bf16), a numpy input per call and a donated carry, as
the engine's step takes them. Ways:

  scan-inplace         lax.scan over the stacked weights; cuBLAS reads each layer's slice in place
                       (XLA's dynamic-slice fusion: the engine's looped buckets)
  scan-copied          the same with dynamic-slice fusion off: each layer's weights are copied out
  unrolled-inplace     a Python loop over the layers, static slices of the stack (the engine's
                       unrolled buckets)
  unrolled-copied      the same with dynamic-slice fusion off
  per-layer            a Python loop over a list of per-layer weight arrays: no slice at all, 4 more
                       argument leaves a layer

For each way and `--rows`: `call ms`, the host time of the call alone (each call waited for
before the next); `busy call ms`, the host time of a call made while the previous one still runs
(each call's predecessor waited for after it, as the engine's asynchronous loop does: the
allocator then cannot give the new call the buffers the running one holds); and `pipelined ms`,
wall time per call with calls issued back to back (what the device takes when the host keeps
ahead). Medians.

    python -m benchmarks.stacked_weight_call --rows 1 32 256 --output-json stacked_weight_call.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import mrv2_jax  # noqa: F401  (the engine's XLA flags)

HIDDEN, QKV, Q, INTER = 1024, 4096, 2048, 3072
WAYS = ("scan-inplace", "scan-copied", "unrolled-inplace", "unrolled-copied", "per-layer")


def make_weights(layers: int, hidden: int, seed: int = 0):
    """Stacked [layer, out, in] bf16 weights of the four projections, at a scale that keeps the
    chain finite."""
    import jax
    import jax.numpy as jnp

    q, qkv, inter = Q * hidden // HIDDEN, QKV * hidden // HIDDEN, INTER * hidden // HIDDEN
    shapes = {"qkv": (qkv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {name: (jax.random.normal(k, (layers, *shape), jnp.float32) / np.sqrt(shape[1])).astype(jnp.bfloat16)
            for k, (name, shape) in zip(keys, shapes.items())}


def layer(h, w):
    """One layer's four projections (weights [out, in]) with RMS norms and residual adds; no
    attention."""
    import jax
    import jax.numpy as jnp

    mm = lambda x, m: jnp.einsum("tk,nk->tn", x, m)  # noqa: E731

    def norm(x):
        scale = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6)
        return x * scale.astype(x.dtype)

    q = mm(norm(h), w["qkv"])[:, :w["o"].shape[1]]
    h = h + mm(q, w["o"])
    gate, up = jnp.split(mm(norm(h), w["gate_up"]), 2, axis=-1)
    return norm(h + mm(jax.nn.silu(gate) * up, w["down"]))


def step_fn(way: str):
    """(weights, carry, tokens) -> (carry, a [1, 1] slice of it to wait on), for `way`; compiled
    with the engine's step options (cuBLAS for every GEMM), and dynamic-slice fusion off for the
    copied ways."""
    import jax
    import jax.numpy as jnp

    from mrv2_jax.xla_flags import step_compiler_options

    def step(weights, carry, tokens):
        h = carry + (tokens[:, None] % 7).astype(carry.dtype)
        if way.startswith("scan"):
            h, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), h, weights)
        else:  # unrolled: each layer's static slice of the stack, taken inside the program
            for w in weights if way == "per-layer" else weights_for("per-layer", weights):
                h = layer(h, w)
        return h, h[:1, :1]

    options = step_compiler_options([jax.ShapeDtypeStruct((), jnp.bfloat16)])  # the weights' dtype
    if way.endswith("copied"):
        options["xla_gpu_enable_dynamic_slice_fusion"] = False
    return jax.jit(step, donate_argnums=1, compiler_options=options or None)


def weights_for(way: str, weights):
    """The stacked weights as `way` takes them: a list of per-layer dicts for per-layer."""
    if way != "per-layer":
        return weights
    layers = next(iter(weights.values())).shape[0]
    return [{k: v[i] for k, v in weights.items()} for i in range(layers)]


def measure(way: str, weights, rows: int, calls: int, hidden: int) -> dict:
    import jax
    import jax.numpy as jnp

    step = step_fn(way)
    weights = weights_for(way, weights)
    tokens = [np.arange(rows, dtype=np.int32) + i for i in range(calls)]
    carry = jnp.zeros((rows, hidden), jnp.bfloat16)
    for t in tokens[:3]:  # compile, record the command buffers, settle the allocator
        carry, marker = step(weights, carry, t)
    jax.block_until_ready(carry)
    call, busy = [], []
    for t in tokens:
        start = time.perf_counter()
        carry, marker = step(weights, carry, t)
        call.append(time.perf_counter() - start)
        jax.block_until_ready(carry)
    for t in tokens:
        start = time.perf_counter()
        carry, next_marker = step(weights, carry, t)
        busy.append(time.perf_counter() - start)
        jax.block_until_ready(marker)  # the previous call: one in flight while the next is made
        marker = next_marker
    jax.block_until_ready(carry)
    start = time.perf_counter()
    for t in tokens:
        carry, marker = step(weights, carry, t)
    jax.block_until_ready(carry)
    pipelined = (time.perf_counter() - start) / calls
    assert bool(jnp.isfinite(carry.astype(jnp.float32)).all()), f"{way}: the chain overflowed"
    return {"call_ms": 1e3 * statistics.median(call), "call_p90_ms": 1e3 * float(np.percentile(call, 90)),
            "busy_call_ms": 1e3 * statistics.median(busy), "pipelined_ms": 1e3 * pipelined}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=HIDDEN, help="scales every projection (tests: small)")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of: " + ", ".join(WAYS))
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from mrv2_jax.bench.environment import flag_probe_report

    ways = [w.strip() for w in args.ways.split(",")]
    unknown = set(ways) - set(WAYS)
    if unknown:
        p.error(f"unknown ways {sorted(unknown)}; choose from {list(WAYS)}")
    weights = make_weights(args.layers, args.hidden)
    results = []
    print(f"{'rows':>5} {'way':<20} {'call ms':>8} {'call p90':>9} {'busy call ms':>13} {'pipelined ms':>13}")
    for rows in args.rows:
        for way in ways:
            r = measure(way, weights, rows, args.calls, args.hidden) | {"rows": rows, "way": way}
            results.append(r)
            print(f"{rows:5d} {way:<20} {r['call_ms']:8.3f} {r['call_p90_ms']:9.3f} {r['busy_call_ms']:13.3f} "
                  f"{r['pipelined_ms']:13.3f}")
    return flag_probe_report(args, results, args.output_json)


if __name__ == "__main__":
    main()
