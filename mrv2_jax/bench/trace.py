"""Reading `jax.profiler` traces: the device events of a traced run, by kernel family, and the
device events of one traced call.

Device events are those of the GPU's "Stream" lines in the Perfetto JSON the profiler writes; a
CPU backend has none, so every reader here returns empty results there.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time

# The TraceAnnotation name of an engine step in a trace (bench timeline marks each traced step).
STEP_ANNOTATION = "mrv2_step"


def find_trace(trace_dir: str) -> str | None:
    """The Perfetto JSON that `jax.profiler` wrote under `trace_dir` (newest run)."""
    runs = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*")))
    for run in reversed(runs):
        for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz"):
            found = sorted(glob.glob(os.path.join(run, pattern)))
            if found:
                return found[0]
    return None


def process_and_thread_names(events: list[dict]) -> tuple[dict, dict]:
    """A Perfetto trace's metadata -> ({pid: process name}, {(pid, tid): thread name})."""
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[e["pid"], e.get("tid")] = e["args"]["name"]
    return process, thread


def is_device_process(name: str) -> bool:
    """Whether a trace process holds a device's events (else it is the host's)."""
    return "GPU" in name or name.startswith("/device:")


def read_trace(path: str) -> tuple[list[tuple[int, float, float]], list[tuple[float, float, str]], str]:
    """-> (steps as (index, start_us, end_us), device events as (start_us, end_us, name), which
    device lines were used). Device events are those of the GPU processes' "Stream" lines (raw
    kernels and copies); the derived lines ("XLA Modules", "XLA Ops") span idle time within a
    module and would overstate the busy time, so they are used only if no Stream line exists."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    process, thread = process_and_thread_names(events)
    devices = {pid for pid, name in process.items() if is_device_process(name)}
    steps, streams, other_device = [], [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        if e.get("name") == STEP_ANNOTATION and e["pid"] not in devices:
            steps.append((int(e.get("args", {}).get("step", -1)), start, end))
        elif e["pid"] in devices:
            line = thread.get((e["pid"], e.get("tid")), "")
            (streams if line.startswith("Stream") else other_device).append((start, end, e.get("name", "")))
    source = "GPU Stream lines" if streams else ("GPU derived lines" if other_device else "none")
    return sorted(steps), sorted(streams or other_device), source


def kernel_family(name: str) -> str:
    """A kernel's name without XLA's instance numbers (`loop_add_fusion_12` -> `loop_add_fusion`,
    `memcpy128` stays), so the 28 layers' copies of one kernel add up."""
    return re.sub(r"([._]\d+)+$", "", name) or name


def kernel_split(events, lo: float, hi: float, num_steps: int, top: int = 60) -> list[dict]:
    """The kernels (by family) that take the device time of the window [lo, hi): per step, their
    time (ms) and launches, and their share of the summed kernel time; the `top` largest."""
    time_us, count = {}, {}
    for start, end, name in events:
        if end <= lo or start >= hi:
            continue
        family = kernel_family(name)
        time_us[family] = time_us.get(family, 0.0) + min(end, hi) - max(start, lo)
        count[family] = count.get(family, 0) + 1
    total = sum(time_us.values()) or 1.0
    ranked = sorted(time_us, key=time_us.get, reverse=True)[:top]
    return [{"kernel": k, "ms_per_step": time_us[k] / 1e3 / num_steps, "launches_per_step": count[k] / num_steps,
             "share": time_us[k] / total} for k in ranked]


def profile_kernels(fn, inputs, calls: int = 10) -> list[dict]:
    """Per call: the kernels (by family) of `calls` traced calls of fn(*inputs), largest first."""
    import jax

    trace_dir = tempfile.mkdtemp(prefix="mrv2-call-trace-")
    try:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(fn(*inputs))
        path = find_trace(trace_dir)
        events = read_trace(path)[1] if path else []
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    if not events:
        return []
    return kernel_split(events, events[0][0], max(e[1] for e in events), calls, top=25)


def call_timeline(fn, inputs, calls: int = 3) -> list[dict]:
    """The device events of the last of `calls` traced calls, in order: offset from that call's
    first event, duration and idle gap before it (µs). Shows where a call's wall time goes that
    no kernel accounts for (conditionals, launches between command buffers)."""
    import jax

    trace_dir = tempfile.mkdtemp(prefix="mrv2-call-trace-")
    try:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(fn(*inputs))
                time.sleep(0.005)  # a gap that marks where one call ends
        path = find_trace(trace_dir)
        events = read_trace(path)[1] if path else []
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    # Calls are separated by the sleep: split at gaps over 2 ms and keep the last group.
    groups, last_end = [[]], None
    for start, end, name in events:
        if last_end is not None and start - last_end > 2000:
            groups.append([])
        groups[-1].append((start, end, name))
        last_end = end if last_end is None else max(last_end, end)
    call = groups[-1]
    if not call:
        return []
    t0, out, prev_end = call[0][0], [], call[0][0]
    for start, end, name in call:
        out.append({"at_us": round(start - t0, 1), "us": round(end - start, 1),
                    "gap_us": round(max(0.0, start - prev_end), 1), "kernel": name})
        prev_end = max(prev_end, end)
    return out
