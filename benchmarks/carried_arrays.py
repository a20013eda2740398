"""What one carried array costs the host per call: a jitted program that takes N small device
arrays and gives N back, three ways, for N in `--counts`:

  donated      the N arrays donated and returned (as the engine's step carries its state)
  read only    the N arrays passed without donation, one array returned
  one table    the same data as one [N, rows] array, donated and returned

Reported: the host time of the call alone (median; each call waited for before the next). The
step program donates and returns the KV cache, DeviceState, SlotState's counts and the result, and
a native profile of its call found a large share in making and freeing arrays (docs/benchmarks.md):
this says what each one costs, apart from any model.

    python -m benchmarks.carried_arrays --counts 1 8 16 32 64 --output-json carried_arrays.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import mrv2_jax  # noqa: F401  (the engine's XLA flags)


def call_ms(call, state, calls: int) -> float:
    """Median host ms of `state = call(state)`, each call waited for."""
    import jax

    state = call(state)
    jax.block_until_ready(state)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        state = call(state)
        times.append(time.perf_counter() - start)
        jax.block_until_ready(state)
    return 1e3 * statistics.median(times)


def ways(count: int, rows: int):
    """{way: (jitted call, its first state)}."""
    import jax
    import jax.numpy as jnp

    arrays = lambda: tuple(jnp.full((rows,), i, jnp.int32) for i in range(count))  # noqa: E731
    donated = jax.jit(lambda xs: tuple(x + 1 for x in xs), donate_argnums=0)
    reader = jax.jit(lambda xs: sum(xs))
    table = jax.jit(lambda t: t + 1, donate_argnums=0)
    return {"donated": (donated, arrays()),
            "read only": (lambda xs: (reader(xs), xs)[1], arrays()),
            "one table": (table, jnp.stack(arrays()))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--rows", type=int, default=256, help="each array's length (int32)")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from mrv2_jax.bench.environment import describe_environment, write_report

    results = {}
    print(f"{'arrays':>6} {'donated ms':>11} {'read only ms':>13} {'one table ms':>13}")
    for count in args.counts:
        r = results[count] = {way: call_ms(call, state, args.calls)
                              for way, (call, state) in ways(count, args.rows).items()}
        print(f"{count:6d} {r['donated']:11.4f} {r['read only']:13.4f} {r['one table']:13.4f}")
    report = describe_environment() | {"settings": vars(args), "results": results}
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
