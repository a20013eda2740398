"""One captured decode step called again and again, for a profiler attached from outside.

    python -m benchmarks.call_loop --model qwen3-0.6b --load-format dummy --rows 1 \
        --ready-file /tmp/ready --seconds 40

Runs `--rows` requests into steady decode, keeps one decode dispatch (as benchmarks.dispatch_cost
does), writes `--ready-file` once the engine is warm, then for `--seconds` calls that step on a
device-resident packed input and waits for each call: the process then spends its time in the
step's call (`ModelRunnerV2.call_step`) and in the wait, nothing else. `gpu_check.sh call-native`
samples it with `py-spy --native` and splits the call with benchmarks.pyspy_tree.
"""

import argparse
import time
from pathlib import Path

from mrv2_jax.entrypoints.cli import add_engine_args


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--ready-file", required=True, help="written once the calls begin")
    add_engine_args(p)
    args = p.parse_args(argv)
    import jax

    from benchmarks.dispatch_cost import alternating, capture_decode_dispatch, one_step_engine

    llm = one_step_engine(args)
    compiled, packed = capture_decode_dispatch(llm, args.rows, args.output_len, args.input_len)
    on_device = jax.device_put(packed)
    step = alternating(llm.engine.runner, [compiled])
    jax.block_until_ready(step(on_device))
    Path(args.ready_file).write_text("ready")
    calls, end = 0, time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        jax.block_until_ready(step(on_device))
        calls += 1
    print(f"{calls} calls in {args.seconds:.0f} s")


if __name__ == "__main__":
    main()
