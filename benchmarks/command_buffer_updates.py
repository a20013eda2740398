"""When does XLA update a recorded command buffer, and what does an update cost the host?

    python -m benchmarks.command_buffer_updates
    XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP python -m benchmarks.command_buffer_updates

A toy decode step: a `lax.scan` over L stacked [H, H] layers applied to a donated state, so the
whole step is one command buffer with a while loop in it (`+WHILE`, as the engine compiles), or
with `--unroll` a Python loop over the layers (one flat program). Four
ways to call it, which differ only in which buffer addresses can change between calls:

  aliased only        every output aliases a donated input; the input is the same device array
  + fresh output      also returns a small array that is not donated (a new buffer every call)
  + fresh input       also takes a new device array every call (a host->device copy each call)
  + both              both of the above

For each: the host time of the call (each call waited for before the next) and, from a host
trace, how many `command_buffer::update` events one call runs and their host time.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

from benchmarks.host_profile import enable_command_buffers_while_profiling, traced_calls


def build(layers: int, hidden: int, rows: int, unroll: bool):
    import jax
    import jax.numpy as jnp

    weights = jax.random.normal(jax.random.key(0), (layers, hidden, hidden), jnp.bfloat16) * 0.02
    x0 = jnp.ones((rows, hidden), jnp.bfloat16)

    def forward(w, h):
        if unroll:  # one static slice per layer: no loop in the program
            for i in range(layers):
                h = jnp.tanh(h @ w[i])
            return h
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), h, w)[0]

    def aliased(w, h, x):
        return forward(w, h + x)

    def with_output(w, h, x):
        h = forward(w, h + x)
        return h, jnp.argmax(h, axis=-1).astype(jnp.int32)

    compiled = {
        "aliased": jax.jit(aliased, donate_argnums=(1,)).lower(weights, x0, x0).compile(),
        "output": jax.jit(with_output, donate_argnums=(1,)).lower(weights, x0, x0).compile(),
    }
    return weights, x0, compiled


def kernel_launches(compiled) -> int:
    """How many instructions of the program's entry computation launch a kernel (fusions and custom
    calls such as cuBLAS GEMMs): about the number of commands in its command buffer."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY"):]
    return len(re.findall(r"= \S+ (?:fusion|custom-call)\(", entry))


def run_case(compiled, weights, x0, fresh_output: bool, fresh_input: bool, calls: int, traced: int) -> dict:
    import jax
    import numpy as np

    fn = compiled["output" if fresh_output else "aliased"]
    state = {"h": jax.numpy.copy(x0)}
    same_input = jax.numpy.copy(x0)
    host_input = np.asarray(x0)

    def call():
        x = jax.device_put(host_input) if fresh_input else same_input
        out = fn(weights, state["h"], x)
        state["h"] = out[0] if fresh_output else out
        return out

    for _ in range(5):
        jax.block_until_ready(call())
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    split = traced_calls(call, traced)
    updates = {k: v for k, v in split["self_us"].items() if "command_buffer::update" in k}
    num_updates = sum(split["count"].get(k, 0) for k in updates)
    return {"call_ms": 1e3 * statistics.median(times), "traced_call_ms": split["call_us"] / 1e3,
            "updates_per_call": num_updates, "update_ms": sum(updates.values()) / 1e3,
            "top": dict(list(split["self_us"].items())[:8])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--unroll", action="store_true", help="a Python loop over the layers instead of lax.scan")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--traced-calls", type=int, default=10)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    enable_command_buffers_while_profiling()
    from mrv2_jax import envs
    from mrv2_jax.bench.environment import flag_probe_report
    from mrv2_jax.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()  # +WHILE, as the engine runs
    weights, x0, compiled = build(args.layers, args.hidden, args.rows, args.unroll)
    cases = {"aliased only": (False, False), "+ fresh output": (True, False), "+ fresh input": (False, True),
             "+ both": (True, True)}
    results = {name: run_case(compiled, weights, x0, *how, args.calls, args.traced_calls)
               for name, how in cases.items()}
    results["kernel_launches"] = launches = kernel_launches(compiled["aliased"])
    print(f"XLA_FLAGS={envs.get_xla_flags()}")
    print(f"layers {args.layers} (unrolled: {args.unroll}), kernel launches in the program: {launches}")
    print(f"{'case':16} {'call ms':>8} {'traced ms':>10} {'updates/call':>13} {'update ms':>10}")
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        print(f"{name:16} {r['call_ms']:8.3f} {r['traced_call_ms']:10.3f} {r['updates_per_call']:13.1f} "
              f"{r['update_ms']:10.3f}")
    return flag_probe_report(args, results, args.output_json)


if __name__ == "__main__":
    main()
