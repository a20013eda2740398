"""Whether a timeline's slow steps are the ones in which XLA recorded a command buffer again.

Reads a `bench timeline --output-json` file (each step's start and wall time) and the stderr of the
same run with XLA's command-buffer log on (`TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3`,
whose update lines carry `updated_allocs=N`), puts every update into the step whose wall time holds it,
and prints how many slow steps (wall over `--slow` x the median) and how many of all steps saw one; and,
apart, the steps that added KV blocks (whose packed input is fresh; the others may pass a repeated one
from the device) and those that did not: how many saw an update, and their median host time in the call.

    python -m benchmarks.step_tail_updates timeline.json timeline.log [--slow 2.0] [--output-json out.json]
"""

import argparse
import bisect
import datetime
import json
import re
import statistics

# glog's prefix: severity, month and day, then the wall clock to the microsecond (the machine's local time).
_GLOG_TIME = re.compile(r"^[IWE](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6})")


def update_times(log_path: str, year: int, tz: datetime.tzinfo) -> list[float]:
    """Epoch seconds of each command-buffer update line in the log."""
    times = []
    with open(log_path, errors="replace") as f:
        for line in f:
            if "updated_allocs=" not in line:
                continue
            m = _GLOG_TIME.match(line)
            if m:
                mo, d, h, mi, s, us = map(int, m.groups())
                times.append(datetime.datetime(year, mo, d, h, mi, s, us, tzinfo=tz).timestamp())
    return sorted(times)


def split(timeline: dict, times: list[float], slow: float) -> dict:
    steps = timeline["steps"]
    t0 = timeline["run_start_epoch_s"]
    median = statistics.median(s["wall_ms"] for s in steps)
    counts = []
    for s in steps:  # updates made while this step's wall clock ran
        start = t0 + s["start_s"]
        counts.append(bisect.bisect_left(times, start + s["wall_ms"] / 1e3) - bisect.bisect_left(times, start))
    slow_idx = [i for i, s in enumerate(steps) if s["wall_ms"] > slow * median]
    by_blocks = {}
    for kind, added in (("new blocks", True), ("no new block", False)):
        idx = [i for i, s in enumerate(steps) if (s.get("new_blocks", 0) > 0) == added]
        calls = {seen: [steps[i]["call_ms"] for i in idx if (counts[i] > 0) == seen and "call_ms" in steps[i]]
                 for seen in (True, False)}
        by_blocks[kind] = dict(steps=len(idx), steps_with_update=sum(counts[i] > 0 for i in idx),
                               call_ms_median_with_update=statistics.median(calls[True]) if calls[True] else None,
                               call_ms_median_without=statistics.median(calls[False]) if calls[False] else None)
    return dict(steps=len(steps), median_wall_ms=median, updates=len(times),
                updates_in_steps=sum(counts), steps_with_update=sum(c > 0 for c in counts),
                slow_steps=len(slow_idx), slow_steps_with_update=sum(counts[i] > 0 for i in slow_idx),
                slow_step_indices=slow_idx[:200], by_blocks=by_blocks)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("timeline_json")
    p.add_argument("log")
    p.add_argument("--slow", type=float, default=2.0, help="a slow step's wall time over the median's")
    p.add_argument("--output-json")
    opts = p.parse_args(argv)
    timeline = json.load(open(opts.timeline_json))
    start = datetime.datetime.fromtimestamp(timeline["run_start_epoch_s"]).astimezone()
    r = split(timeline, update_times(opts.log, start.year, start.tzinfo), opts.slow)
    print(f"{r['steps']} steps (median wall {r['median_wall_ms']:.3f} ms), {r['updates']} command-buffer "
          f"updates in the log, {r['updates_in_steps']} inside steps; steps with an update: "
          f"{r['steps_with_update']} of all, {r['slow_steps_with_update']} of {r['slow_steps']} slow "
          f"(> {opts.slow}x median)")
    for kind, k in r["by_blocks"].items():
        print(f"steps with {kind}: {k['steps']}, {k['steps_with_update']} with an update; median call ms with "
              f"one {k['call_ms_median_with_update']}, without {k['call_ms_median_without']}")
    if opts.output_json:
        with open(opts.output_json, "w") as f:
            json.dump(r, f)


if __name__ == "__main__":
    main()
