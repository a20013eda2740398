"""Where the host time of one decode step's XLA call goes, by XLA's own trace events.

    python -m benchmarks.host_profile --model qwen3-0.6b --load-format dummy --rows 1 256

For each `--rows`, runs that many requests into steady decode, keeps one decode dispatch (as
`benchmarks.dispatch_cost` does), times the call alone, then calls it again under
`jax.profiler` with verbose host tracing: each call inside a `TraceAnnotation` and waited for
before the next. The host events of the PJRT client and the XLA GPU runtime (argument handling,
buffer allocation, thunk execution, command-buffer updates, stream waits) are split into self
time per event name (time not inside a nested event of the same thread): the median over the
traced calls, per call.

The profiler turns XLA's command buffers off while it runs unless
`--xla_enable_command_buffers_during_profiling=true` is in XLA_FLAGS; this benchmark adds it, so
the traced calls run the same program the untimed ones do. Compare `call ms` with and without
tracing: the trace's own overhead is in the difference. On GPUs the same is done once more with
nothing moved between calls (two loaded copies of the step alternated on one device-resident
input, so no recorded command buffer is updated): what the call costs without updates.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import statistics
import tempfile
import time

CALL_ANNOTATION = "mrv2_call"
PROFILING_FLAG = "--xla_enable_command_buffers_during_profiling"


def event_family(name: str) -> str:
    """An event's name without per-instance parts: TraceMe metadata after '#', trailing ids."""
    name = name.split("#", 1)[0].strip()
    return re.sub(r"([._:]\d+)+$", "", name) or name


def self_times(events: list[tuple[float, float, str]]) -> dict[str, float]:
    """Self time per event name of one thread's nested events [(start, end, name)]: each event's
    duration less the time covered by events nested inside it."""
    out: dict[str, float] = {}
    stack: list[list] = []  # [end, name, child time]

    def close(top):
        start_end, name, children = top
        out[name] = out.get(name, 0.0) + start_end[1] - start_end[0] - children

    for start, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0][1] <= start:
            close(stack.pop())
        if stack:
            end = min(end, stack[-1][0][1])
            stack[-1][2] += end - start
        stack.append([(start, end), name, 0.0])
    while stack:
        close(stack.pop())
    return out


def host_split(trace: dict, calls_expected: int) -> dict:
    """From a Perfetto trace: the host self time (µs per call) of every event family inside the
    annotated calls, per thread name (the median over the calls), and the calls' median wall time."""
    from mrv2_jax.bench.trace import is_device_process, process_and_thread_names

    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process, thread = process_and_thread_names(events)
    host = {pid for pid, name in process.items() if not is_device_process(name)}
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] in host]
    calls = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in spans
                   if e.get("name") == CALL_ANNOTATION)
    if not calls:
        return {"calls": 0, "call_us": 0.0, "self_us": {}}
    # Each call's events, by thread, clipped to the call (time between calls is not counted).
    per_call: list[dict[str, list]] = [{} for _ in calls]
    for e in spans:
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        for i, (lo, hi) in enumerate(calls):
            if start < hi and end > lo:
                key = thread.get((e["pid"], e.get("tid")), str(e.get("tid")))
                per_call[i].setdefault(key, []).append((max(start, lo), min(end, hi), event_family(e.get("name", ""))))
                break
    splits, counts = [], []
    for threads in per_call:
        split, count = {}, {}
        for name, evs in threads.items():
            for family, us in self_times(evs).items():
                split[f"{name} | {family}"] = split.get(f"{name} | {family}", 0.0) + us
            for _, _, family in evs:
                count[f"{name} | {family}"] = count.get(f"{name} | {family}", 0) + 1
        splits.append(split)
        counts.append(count)
    names = {k for split in splits for k in split}
    median = {k: statistics.median(split.get(k, 0.0) for split in splits) for k in names}
    wall = [hi - lo for lo, hi in calls]
    return {"calls": len(calls), "calls_expected": calls_expected, "call_us": statistics.median(wall),
            "self_us": dict(sorted(median.items(), key=lambda kv: -kv[1])),
            "count": {k: statistics.median(c.get(k, 0) for c in counts) for k in median}}


def traced_calls(call, calls: int) -> dict:
    """Run `calls` calls of `call()` (it returns device arrays) under the profiler, verbose host
    tracing, each waited for -> host_split of the trace."""
    import jax

    from mrv2_jax.bench.trace import find_trace

    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 3
    options.python_tracer_level = 0
    trace_dir = tempfile.mkdtemp(prefix="mrv2-host-trace-")
    try:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
            for _ in range(calls):
                with jax.profiler.TraceAnnotation(CALL_ANNOTATION):
                    result = call()
                jax.block_until_ready(result)
                time.sleep(0.0005)  # keeps the calls apart in the trace
        path = find_trace(trace_dir)
        if path is None:
            return {"calls": 0, "call_us": 0.0, "self_us": {}}
        with gzip.open(path, "rt") as f:
            return host_split(json.load(f), calls)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def print_split(split: dict, top: int) -> None:
    for name, us in list(split["self_us"].items())[:top]:
        print(f"  {us:9.1f} us  {name}")


def enable_command_buffers_while_profiling() -> None:
    from mrv2_jax import envs

    flags = envs.get_xla_flags()
    if PROFILING_FLAG not in flags:
        envs.set_xla_flags(f"{flags} {PROFILING_FLAG}=true".strip())


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--traced-calls", type=int, default=20)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--output-json", default=None)
    from mrv2_jax.entrypoints.cli import add_engine_args

    add_engine_args(p)
    args = p.parse_args(argv)
    enable_command_buffers_while_profiling()  # before JAX starts its backend
    import jax
    import numpy as np

    from benchmarks.dispatch_cost import alternating, capture_decode_dispatch, one_step_engine, time_calls
    from mrv2_jax import envs
    from mrv2_jax.bench.environment import flag_probe_report
    from mrv2_jax.runner.step_twins import load_twin

    llm = one_step_engine(args)
    runner = llm.engine.runner
    results = {}
    for rows in args.rows:
        compiled, packed = capture_decode_dispatch(llm, rows, args.output_len, args.input_len)
        on_device = jax.device_put(packed)
        step = alternating(runner, [compiled])
        # The engine's way (a fresh numpy packed input per call) is the one traced.
        timed = time_calls(step, lambda: np.array(packed), args.calls)
        resident = time_calls(step, lambda: on_device, args.calls)
        split = traced_calls(lambda: step(np.array(packed)), args.traced_calls)
        results[rows] = {"untraced": timed, "device_resident": resident, "traced": split}
        print(f"\nrows {rows}: call {timed['call_ms']:.3f} ms untraced ({resident['call_ms']:.3f} ms with the "
              f"input on the device), {split['call_us'] / 1e3:.3f} ms traced ({split['calls']} calls); "
              "host self time per call:")
        print_split(split, args.top)
        if jax.default_backend() == "gpu":  # XLA:CPU cannot serialize the step for a twin
            # Nothing moved: two copies of the step alternated on one device-resident input, so
            # no recorded command buffer is updated (dispatch_cost's `device twins`).
            twins = alternating(runner, [compiled, load_twin(compiled)])
            still = time_calls(twins, lambda: on_device, args.calls)
            still_split = traced_calls(lambda: twins(on_device), args.traced_calls)
            results[rows] |= {"nothing_moved": still, "nothing_moved_traced": still_split}
            print(f"rows {rows}, nothing moved: call {still['call_ms']:.3f} ms untraced, "
                  f"{still_split['call_us'] / 1e3:.3f} ms traced; host self time per call:")
            print_split(still_split, args.top)
    print(f"XLA_FLAGS={envs.get_xla_flags()}")
    return flag_probe_report(args, results, args.output_json)


if __name__ == "__main__":
    main()
