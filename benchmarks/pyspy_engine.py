"""Where a serving engine process's busy host time goes, from a py-spy raw profile.

    python -m benchmarks.pyspy_engine serve_pyspy.txt [--top 40]

Reads py-spy's `--format raw` output (one line per distinct stack: frames joined by ";", then a
sample count; `gpu_check.sh serve-pyspy` records one with `--subprocesses --idle`), keeps the
samples of the thread that runs the engine loop (`EngineCoreProc._loop`), drops those where it
waits for input (ZMQ's poll: the engine had no work), and prints each function's inclusive share
of what is left, largest first. Line numbers are folded, so a function counts once per sample.
"""

import argparse
import re
from collections import Counter

ENGINE_LOOP = "EngineCoreProc._loop"
IDLE_LEAF = "Poller.poll"


def function_name(frame: str) -> str:
    """`name (path/to/file.py:123)` -> `name (file.py)`."""
    match = re.match(r"(.*?) \((?:.*/)?([^/:]+)(?::\d+)?\)$", frame)
    return f"{match.group(1)} ({match.group(2)})" if match else frame


def engine_busy_shares(lines) -> tuple[int, int, Counter]:
    """-> (engine loop samples, busy samples, {function: busy samples that include it})."""
    total = busy = 0
    inclusive = Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or ENGINE_LOOP not in stack:
            continue
        frames = stack.split(";")
        start = next(i for i, f in enumerate(frames) if f.startswith(ENGINE_LOOP))
        names = [function_name(f) for f in frames[start:]]
        total += int(count)
        if names[-1].startswith(IDLE_LEAF):
            continue
        busy += int(count)
        for name in set(names):
            inclusive[name] += int(count)
    return total, busy, inclusive


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    with open(args.profile) as f:
        total, busy, inclusive = engine_busy_shares(f)
    if not busy:
        raise SystemExit(f"no busy engine-loop samples in {args.profile} ({total} idle): sample while it serves")
    print(f"engine loop: {total} samples, {busy} busy ({100 * busy / total:.1f}%)")
    for name, n in inclusive.most_common(args.top):
        print(f"{100 * n / busy:6.1f}%  {name}")


if __name__ == "__main__":
    main()
