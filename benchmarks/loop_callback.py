"""Can fused decode hand each step's tokens to the host as they are made? A probe for streaming
without bursts (issue 24): one compiled call runs K steps of a toy decode loop (L stacked [H, H]
layers on R rows, in a `lax.fori_loop`, as fused decode does), three ways:

  loop                 K steps in one call; the host reads the K steps' tokens after the call
  loop + callback      the same, each step also sends its tokens to a host function
                       (`jax.experimental.io_callback`) that notes when they arrive
  one step per call    K calls of a one-step program, each step's tokens read by the host
                       before the next call (what a stream gets with --stream-interval 1)

Reported per way: milliseconds per step (median over calls) and, for the callback, the median and
largest gap between two steps' arrivals on the host (what a stream's chunks would see). If the
callback costs the loop little, fused decode could stream every token at the loop's pace.

    python -m benchmarks.loop_callback --steps 16 --layers 28 --hidden 4096 --rows 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mrv2_jax  # noqa: F401  (the engine's XLA flags: command buffers as the engine runs them)


def build(layers: int, hidden: int, rows: int, steps: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    weights = jax.random.normal(jax.random.key(0), (layers, hidden, hidden), jnp.bfloat16) * 0.02
    x0 = jnp.ones((rows, hidden), jnp.bfloat16)
    arrivals: list[float] = []

    def note(tokens):
        arrivals.append(time.perf_counter())
        return None

    def one_step(w, h):
        h = jax.lax.fori_loop(0, layers, lambda i, h: jnp.tanh(h @ w[i]), h)
        return h, jnp.argmax(h, axis=-1).astype(jnp.int32)

    def loop(w, h, with_callback: bool):
        def body(k, carry):
            h, tokens = carry
            h, t = one_step(w, h)
            if with_callback:
                io_callback(note, None, t, ordered=False)
            return h, tokens.at[k].set(t)

        return jax.lax.fori_loop(0, steps, body, (h, jnp.zeros((steps, rows), jnp.int32)))

    programs = {
        "loop": jax.jit(lambda w, h: loop(w, h, False)),
        "loop + callback": jax.jit(lambda w, h: loop(w, h, True)),
        "one step per call": jax.jit(one_step),
    }
    return weights, x0, programs, arrivals


def time_way(name, program, weights, x0, steps: int, calls: int, arrivals: list) -> dict:
    import jax
    import numpy as np

    per_step, gaps = [], []
    for call in range(calls + 1):  # the first call compiles
        arrivals.clear()
        start = time.perf_counter()
        if name == "one step per call":
            h = x0
            for _ in range(steps):
                h, t = program(weights, h)
                np.asarray(t)  # the host reads this step's tokens before the next call
                arrivals.append(time.perf_counter())
        else:
            h, tokens = program(weights, x0)
            np.asarray(tokens)
        jax.block_until_ready(h)
        if call:
            per_step.append((time.perf_counter() - start) / steps * 1e3)
            gaps += [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    out = {"ms_per_step": statistics.median(per_step)}
    if gaps:
        out |= {"gap_ms_median": statistics.median(gaps), "gap_ms_max": max(gaps), "arrivals_per_call": len(arrivals)}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from mrv2_jax.bench.environment import describe_environment

    weights, x0, programs, arrivals = build(args.layers, args.hidden, args.rows, args.steps)
    results = {name: time_way(name, prog, weights, x0, args.steps, args.calls, arrivals)
               for name, prog in programs.items()}
    print(f"{'way':20} {'ms/step':>8} {'gap median':>11} {'gap max':>8}")
    for name, r in results.items():
        print(f"{name:20} {r['ms_per_step']:8.3f} {r.get('gap_ms_median', float('nan')):11.3f} "
              f"{r.get('gap_ms_max', float('nan')):8.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**describe_environment(), "settings": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
