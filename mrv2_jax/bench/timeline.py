"""Per-step timeline of an engine run: where each step's wall time goes on the host, and how busy
the GPU is under it.

    mrv2-jax bench timeline --model qwen3-0.6b --load-format dummy --max-num-seqs 256 \
        --max-num-batched-tokens 8192 --max-model-len 1024 --input-len 128 --output-len 512 \
        --num-prompts 256 --output-json timeline.json

Host side, every step (from perf_counter around the engine's own calls, wrapped from here so the
engine is unchanged): scheduling, dispatch (the runner's `execute`: input preparation and the
jitted call; the call alone is shown as "jit call" where the runner's hook reports it), the wait for
the previous step's sampled tokens (`result()`; with async scheduling this is step N-1's, read
after step N is dispatched), the scheduler update, and the time outside the engine step (output
processing, detokenization) until the next step starts; "host step" is all of these but the wait.
Each step also records what it carried (new requests, new KV blocks) and the Python garbage
collections that ran in it, and the summary sets the slowest 1% of steps beside the median ones
("the tail"): which part of the step grew.

Device side, for a window of steady-decode steps (every row decoding, at full concurrency; with
`--max-fused-steps K` a fused call of K tokens a row is such a step), a
`jax.profiler` trace: the GPU's kernel and copy events (the "Stream" lines of the device), merged
into busy intervals and set against each step's interval on the same clock (the step is a
TraceAnnotation there). Per step: device busy time, idle time and the longest idle gap; over the
window: the GPU busy fraction = union of kernel time / wall span, and the kernels that take the
time (by family: XLA's instance numbers stripped, so the layers' copies of a kernel add up). The trace (Perfetto JSON,
open it at ui.perfetto.dev) is kept. The profiler itself adds some host and launch overhead in the
window: compare the window's host times with the steady steps outside it (both reported).

On a CPU backend there are no device events: the device part is None, with a note.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import tempfile
import time

from mrv2_jax.bench.dataset import random_prompts
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.bench.sampling import sampling_params
from mrv2_jax.bench.step_log import attach_hooks
from mrv2_jax.bench.trace import STEP_ANNOTATION, find_trace, kernel_split, read_trace
from mrv2_jax.entrypoints.cli import add_engine_args, engine_kwargs
from mrv2_jax.runner.step_hooks import StepHooks

HOST_PARTS = ("schedule_ms", "dispatch_ms", "wait_ms", "update_ms", "outside_ms")
# What a profiler trace holds of a fused call (docs/benchmarks.md, "Where a fused-decode token's device
# time goes"): about one loop iteration's kernels, the rest of the loop's command buffer running unseen.
FUSED_TRACE_NOTE = ("fused calls: the trace holds about one loop iteration's kernels per call (GPU busy ~1/K of "
                    "the window), so the split above is about one token's, not the call's")


# --- host side: wrap the engine's calls -----------------------------------------------------
class _TimedResult:
    """Stands in for a runner's step result; times `result()` (the wait for the tokens)."""

    def __init__(self, inner, on_wait):
        self._inner, self._on_wait = inner, on_wait

    def result(self):
        t0 = time.perf_counter()
        value = self._inner.result()
        self._on_wait(time.perf_counter() - t0)
        return value

    def __getattr__(self, name):  # logprobs() and anything else the engine asks for
        return getattr(self._inner, name)


class StepRecorder(StepHooks):
    """Wraps one engine's step, schedule, execute, result and update (instance attributes, so
    nothing changes for other engines) and records each step's parts; as the engine's hooks it
    also gets the host time of the runner's jitted call (V2). Starts a profiler trace
    before the `skip + 1`-th steady-decode step (or before step `from_step`, whatever its kind:
    prefill-heavy settings) and stops it `window` steps later."""

    def __init__(self, engine, rows: int, *, skip: int, window: int, trace_dir: str | None,
                 from_step: int | None = None):
        self.engine, self.rows, self.skip, self.window, self.trace_dir = engine, rows, skip, window, trace_dir
        self.from_step = from_step
        self.steps: list[dict] = []
        self.tracing = False
        self.trace_done = trace_dir is None
        self._steady_seen = 0
        self._current: dict | None = None
        self._gc_start: float | None = None
        self._wrap()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        """A collection's time goes to the step it ran in (including that step's time outside)."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None and self._current is not None:
            self._current["gc_ms"] += 1e3 * (time.perf_counter() - self._gc_start)
            self._current["gc_gen"] = max(self._current["gc_gen"], info["generation"])

    def _wrap(self):
        import jax

        engine, scheduler, runner = self.engine, self.engine.scheduler, self.engine.runner
        step, schedule, execute, update = engine.step, scheduler.schedule, runner.execute, scheduler.update_from_output

        def add(key, seconds):
            self._current[key] += 1e3 * seconds

        def timed_schedule():
            t0 = time.perf_counter()
            out = schedule()
            add("schedule_ms", time.perf_counter() - t0)
            self._current["num_tokens"] = out.total_num_scheduled_tokens
            self._current["num_reqs"] = len(out.num_scheduled_tokens)
            self._current["fused_steps"] = out.num_fused_steps
            self._current["new_reqs"] = len(out.new_reqs)
            self._current["new_blocks"] = sum(len(c.new_block_ids) for c in out.cached_reqs)
            return out

        def timed_execute(out):
            t0 = time.perf_counter()
            result = execute(out)
            add("dispatch_ms", time.perf_counter() - t0)
            return _TimedResult(result, lambda s: add("wait_ms", s))

        def timed_update(*args, **kwargs):
            t0 = time.perf_counter()
            outputs = update(*args, **kwargs)
            add("update_ms", time.perf_counter() - t0)
            return outputs

        def timed_step():
            index = len(self.steps)
            self._maybe_toggle_trace(index)
            self._current = record = {"step": index, "start": time.perf_counter(), "num_tokens": 0, "num_reqs": 0,
                                      "fused_steps": 1,
                                      "new_reqs": 0, "new_blocks": 0, "gc_ms": 0.0, "gc_gen": -1,
                                      "schedule_ms": 0.0, "dispatch_ms": 0.0, "call_ms": 0.0, "wait_ms": 0.0,
                                      "update_ms": 0.0, "traced": self.tracing, "usage": usage()}
            if self.tracing:
                with jax.profiler.TraceAnnotation(STEP_ANNOTATION, step=index):
                    outputs = step()
            else:
                outputs = step()
            record["end"] = time.perf_counter()
            self.steps.append(record)
            if steady_decode(record, self.rows):
                self._steady_seen += 1
            return outputs

        engine.step, scheduler.schedule, runner.execute = timed_step, timed_schedule, timed_execute
        scheduler.update_from_output = timed_update
        attach_hooks(engine, self)

    def dispatched(self, runner, compiled, packed, call_s: float) -> None:
        self._current["call_ms"] += 1e3 * call_s

    def _maybe_toggle_trace(self, index: int):
        import jax

        if self.trace_done:
            return
        start = index >= self.from_step if self.from_step is not None else self._steady_seen >= self.skip + 1
        if not self.tracing and start:
            # Python tracing off: it would add its cost to every Python call of the host path.
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            jax.profiler.start_trace(self.trace_dir, create_perfetto_trace=True, profiler_options=options)
            self.tracing, self._trace_first = True, index
        elif self.tracing and index - self._trace_first >= self.window:
            self.stop_trace()

    def stop_trace(self):
        import jax

        if self.tracing:
            jax.block_until_ready(self.engine.runner.kv_cache)  # the window's device work is in the trace
            jax.profiler.stop_trace()
            self.tracing, self.trace_done = False, True

    def finish(self) -> list[dict]:
        """Close the trace if the run ended inside the window; fill in per-step derived times."""
        self.stop_trace()
        attach_hooks(self.engine, None)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        for record, following in zip(self.steps, self.steps[1:] + [None]):
            engine_ms = 1e3 * (record["end"] - record["start"])
            record["engine_ms"] = engine_ms
            record["host_other_ms"] = engine_ms - sum(record[k] for k in HOST_PARTS if k != "outside_ms")
            record["outside_ms"] = 1e3 * (following["start"] - record["end"]) if following else 0.0
            record["wall_ms"] = 1e3 * (following["start"] - record["start"]) if following else engine_ms
            record["host_ms"] = record["wall_ms"] - record["wait_ms"]  # all but the wait for the device
            until = following["usage"] if following else usage()  # over the step's wall time (the last: to now)
            record.update(zip(USAGE_KEYS, (b - a for a, b in zip(record["usage"], until))))
        for record in self.steps:
            del record["usage"]
        return self.steps


# --- device side: read the trace -------------------------------------------------------------
def merge(intervals) -> list[tuple[float, float]]:
    """Union of (start, end, ...) intervals as sorted, disjoint (start, end) pairs."""
    merged: list[list[float]] = []
    for start, end, *_ in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def busy_within(busy: list[tuple[float, float]], lo: float, hi: float) -> tuple[float, float]:
    """(busy time, longest idle gap) of merged `busy` intervals within [lo, hi)."""
    total, longest, cursor = 0.0, 0.0, lo
    for start, end in busy:
        if end <= lo or start >= hi:
            continue
        start, end = max(start, lo), min(end, hi)
        longest = max(longest, start - cursor)
        total += end - start
        cursor = end
    return total, max(longest, hi - cursor)


def device_timeline(trace_path: str) -> dict:
    """Per traced step: device busy and idle (ms) within the step's interval (from its start to
    the next traced step's start), and the longest idle gap; over the window: the busy
    fraction."""
    steps, device, source = read_trace(trace_path)
    if not device:
        return {"device_source": source, "note": "no device kernel events in the trace (a CPU backend has "
                "none): device time is not measured", "steps": {}, "busy_fraction": None}
    busy = merge(device)
    per_step = {}
    for (index, start, _), following in zip(steps, steps[1:] + [None]):
        end = following[1] if following else steps[-1][2]
        on, gap = busy_within(busy, start, end)
        per_step[index] = {"device_busy_ms": on / 1e3, "device_idle_ms": (end - start - on) / 1e3,
                           "max_idle_gap_ms": gap / 1e3}
    span_lo, span_hi = steps[0][1], steps[-1][2]
    on, gap = busy_within(busy, span_lo, span_hi)
    return {"device_source": source, "steps": per_step, "window_span_ms": (span_hi - span_lo) / 1e3,
            "window_busy_ms": on / 1e3, "busy_fraction": on / (span_hi - span_lo),
            "num_device_events": len(device),
            "kernels": kernel_split(device, span_lo, span_hi, max(1, len(steps)))}


# --- the run ---------------------------------------------------------------------------------
def medians(records: list[dict], keys) -> dict:
    return {k: statistics.median(r[k] for r in records) if records else None for k in keys}


def steady_decode(step: dict, rows: int) -> bool:
    """Every one of `rows` rows decoding: one token each, or K in a fused call of K steps."""
    return step["num_reqs"] == rows and step["num_tokens"] == rows * step["fused_steps"]


TAIL_FLAGS = {"with gc": lambda s: s["gc_ms"] > 0, "new requests": lambda s: s["new_reqs"] > 0,
              "new blocks": lambda s: s["new_blocks"] > 0,
              "prefill": lambda s: s["num_tokens"] > s["num_reqs"] * s["fused_steps"],
              "page faults": lambda s: s.get("page_faults", 0) > 0,
              "preempted": lambda s: s.get("involuntary_switches", 0) > 0}
USAGE_KEYS = ("page_faults", "involuntary_switches", "voluntary_switches")
_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # Linux's: the calling thread alone


def usage() -> tuple[int, int, int]:
    """The process's page faults (minor and major) and the calling thread's involuntary and voluntary
    context switches so far: a step that stalled on memory or lost its CPU shows in their growth."""
    process, thread = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(_THREAD)
    return process.ru_minflt + process.ru_majflt, thread.ru_nivcsw, thread.ru_nvcsw


def tail(steps: list[dict], parts, quantile: float = 0.99) -> dict | None:
    """The slowest steps by wall time (at or above the quantile) beside all steps: each part's
    median in both, and the share of steps in both that collected garbage, admitted requests,
    added KV blocks or prefilled. Untraced steps only (the profiler slows the host)."""
    steps = [s for s in steps if not s["traced"] and s["num_tokens"]]
    if len(steps) < 2:
        return None
    walls = sorted(s["wall_ms"] for s in steps)
    cut = walls[min(len(walls) - 1, int(quantile * len(walls)))]
    slow = [s for s in steps if s["wall_ms"] >= cut]

    def describe(group):
        shares = {name: sum(map(test, group)) / len(group) for name, test in TAIL_FLAGS.items()}
        return {"num_steps": len(group), "median": medians(group, (*parts, "gc_ms", *USAGE_KEYS)), "share": shares}

    return {"quantile": quantile, "wall_p50_ms": walls[len(walls) // 2], "wall_cut_ms": cut,
            "slow": describe(slow), "all": describe(steps)}


def memory_kb(*fields: str) -> dict[str, int]:
    """The host's /proc/meminfo fields in kB (empty where the file is missing)."""
    try:
        with open("/proc/meminfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    values = {line.split(":")[0]: int(line.split()[1]) for line in lines}
    return {field: values[field] for field in fields if field in values}


def settle_host(seconds: float) -> dict:
    """Wait `seconds` (--settle-s) between the warm-up and the timed run, so that whatever start-up left
    the host doing runs out first. -> the host's dirty file pages before and after."""
    report = {"before": memory_kb("Dirty", "Writeback")}
    time.sleep(seconds)
    report["after"] = memory_kb("Dirty", "Writeback")
    return report


def run(args) -> dict:
    from mrv2_jax.llm import LLM
    from mrv2_jax.sampling_params import SamplingParams

    t0 = time.perf_counter()
    # One dispatch per step unless asked otherwise: the timeline is per step, and a fused call
    # (runner/fused.py) would be K steps in one.
    kwargs = engine_kwargs(args)
    kwargs["max_fused_steps"] = kwargs.get("max_fused_steps") or 1
    llm = LLM(**kwargs)
    llm.wait_for_compiles()  # no compile beside the timed steps
    startup = time.perf_counter() - t0
    prompts = random_prompts(args.num_prompts, args.input_len, 0.0, llm.model_state.vocab_size, args.dataset_seed)
    constraint = json.loads(args.structured_outputs) if args.structured_outputs else None
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=constraint is None,
                            structured_outputs=constraint)
    if args.sampling == "all":  # every sampler feature on every request (bench ab --sampling all)
        params = sampling_params("all", args.output_len, llm.model_state.vocab_size)
    warm_up_start = time.perf_counter()
    llm.generate(prompts[: min(len(prompts), 16)], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    warm_up = time.perf_counter() - warm_up_start
    settle = settle_host(args.settle_s)
    rows = min(args.max_num_seqs, len(prompts))
    trace_dir = tempfile.mkdtemp(prefix="mrv2-trace-") if args.window > 0 else None
    recorder = StepRecorder(llm.engine, rows, skip=args.skip_steps, window=args.window, trace_dir=trace_dir,
                            from_step=args.trace_from_step)
    epoch_at_t0, t0 = time.time(), time.perf_counter()  # the epoch lines steps up with other clocks' logs
    try:
        outs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
        elapsed = time.perf_counter() - t0
    finally:  # a failed run still stops its trace and unhooks the engine and the collector
        steps = recorder.finish()

    device = {"note": "no trace taken (--window 0)", "steps": {}, "busy_fraction": None}
    trace_path = find_trace(trace_dir) if trace_dir else None
    if trace_dir and trace_path is None:
        device = {"note": "the traced window was not reached: lower --skip-steps / --trace-from-step or raise "
                          "the workload",
                  "steps": {}, "busy_fraction": None}
    if trace_path:
        device = device_timeline(trace_path)
        for index, values in device["steps"].items():
            steps[index].update(values)
        out_trace = args.trace_out or (os.path.splitext(args.output_json)[0] + ".trace.json.gz"
                                       if args.output_json else None)
        if out_trace:
            shutil.copyfile(trace_path, out_trace)
            device["trace_file"] = out_trace
    if trace_dir:
        shutil.rmtree(trace_dir, ignore_errors=True)

    steady = [s for s in steps if steady_decode(s, rows)]
    # The window: its steady-decode steps, or with --trace-from-step every step it traced.
    window = [s for s in (steps if args.trace_from_step is not None else steady) if s["traced"]]
    parts = (*HOST_PARTS, "call_ms", "host_other_ms", "host_ms", "engine_ms", "wall_ms")
    device_parts = ("device_busy_ms", "device_idle_ms", "max_idle_gap_ms")
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    config = llm.config
    report = {
        **describe_environment(), "settings": vars(args), "runner": config.runner,
        "async_scheduling": llm.engine.async_scheduling, "startup_s": startup, "warm_up_s": warm_up,
        "settle": settle,
        "elapsed_s": elapsed,
        "output_tokens_per_s": num_out / elapsed, "num_steps": len(steps), "steady_decode_rows": rows,
        "num_steady_steps": len(steady), "num_window_steps": len(window),
        "window_tokens_per_step": statistics.median(s["num_tokens"] for s in window) if window else None,
        "window_fused_steps": max((s["fused_steps"] for s in window), default=1),
        "steady_median": medians([s for s in steady if not s["traced"]], parts),
        "window_median": medians(window, parts) | medians([s for s in window if "device_busy_ms" in s],
                                                          device_parts),
        "tail": tail(steps, parts),
        "device_trace": {k: v for k, v in device.items() if k != "steps"},  # ("device" names the GPU)
        "run_start_epoch_s": epoch_at_t0,
        "steps": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()
                   if k not in ("start", "end")} | {"start_s": round(s["start"] - t0, 6)} for s in steps],
    }
    print_summary(report)
    if args.output_json:
        write_report(report, args.output_json)
    return report


def print_summary(report: dict) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.3f}"
    print(f"\nrunner {report['runner']}, async {report['async_scheduling']}: {report['output_tokens_per_s']:.0f} "
          f"output tok/s; {report['num_steady_steps']} steady-decode steps of {report['steady_decode_rows']} rows, "
          f"{report['num_window_steps']} traced")
    print(f"{'median ms per step':20} {'schedule':>9} {'dispatch':>9} {'wait':>9} {'update':>9} {'outside':>9} "
          f"{'(jit call)':>10} {'host step':>9} {'wall':>9} {'dev busy':>9} {'dev idle':>9}")
    for label, key in (("steady, untraced", "steady_median"), ("traced window", "window_median")):
        m = report[key]
        print(f"{label:20} " + " ".join(f"{fmt(m.get(k)):>9}" for k in HOST_PARTS) + f" {fmt(m.get('call_ms')):>10} "
              + " ".join(f"{fmt(m.get(k)):>9}" for k in ("host_ms", "wall_ms", "device_busy_ms", "device_idle_ms")))
    if report.get("tail"):
        t = report["tail"]
        print(f"the tail: wall P50 {t['wall_p50_ms']:.3f} ms, P{100 * t['quantile']:g} {t['wall_cut_ms']:.3f} ms")
        for label in ("slow", "all"):
            group = t[label]
            m, share = group["median"], group["share"]
            print(f"{label + ' steps (' + str(group['num_steps']) + ')':20} "
                  + " ".join(f"{fmt(m.get(k)):>9}" for k in HOST_PARTS) + f" {fmt(m.get('call_ms')):>10} "
                  + f"{fmt(m.get('wall_ms')):>9}   " + ", ".join(f"{k} {v:.0%}" for k, v in share.items()))
    device = report["device_trace"]
    if device.get("busy_fraction") is not None:
        print(f"GPU busy fraction over the window: {device['busy_fraction']:.1%} "
              f"({device['window_busy_ms']:.1f} of {device['window_span_ms']:.1f} ms; {device['device_source']})")
        print(f"{'kernel (family)':48} {'ms/step':>8} {'launches/step':>13} {'share':>6}")
        for k in device.get("kernels", [])[: report["settings"].get("top_kernels", 10)]:
            print(f"{k['kernel'][:48]:48} {k['ms_per_step']:8.3f} {k['launches_per_step']:13.1f} {k['share']:6.1%}")
        if report["window_fused_steps"] > 1:
            print(FUSED_TRACE_NOTE)
    else:
        print(f"device: {device.get('note')}")


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=256,
                   help="default 256: one wave at --max-num-seqs 256, so most steps are steady decode")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sampling", choices=["plain", "all"], default="plain",
                   help="all: every sampler feature on every request, as `bench ab --sampling all` "
                        "(--temperature is then ignored)")
    p.add_argument("--top-kernels", type=int, default=10, help="kernel families to print")
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--skip-steps", type=int, default=50, help="steady-decode steps before the traced window")
    p.add_argument("--window", type=int, default=50, help="steps in the traced window (0: no trace)")
    p.add_argument("--trace-from-step", type=int, default=None, metavar="N",
                   help="trace from step N of the timed run whatever the steps are (prefill-heavy "
                        "settings such as input 1024 / output 128) instead of after --skip-steps steady ones")
    p.add_argument("--trace-out", default=None, help="where to keep the Perfetto trace (default: beside "
                   "--output-json, as NAME.trace.json.gz)")
    p.add_argument("--structured-outputs", default=None,
                   help="a JSON object of StructuredOutputsParams fields given to every timed request (needs "
                        "--tokenizer for a preset; EOS then ends a request where its constraint allows)")
    p.add_argument("--settle-s", type=float, default=0.0,
                   help="seconds to wait between the warm-up and the timed run (default 0)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
