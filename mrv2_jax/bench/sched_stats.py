"""How the OS scheduled a server's processes while a benchmark ran (Linux /proc): for each process
under the server, its threads' CPU time, their time waiting in a run queue for a CPU, and how often
they were switched out against their will. A step that leaves the engine process late while the
device has long finished was either working or waiting for a CPU; these numbers tell the two apart."""

from __future__ import annotations

import os


def children(pid: int) -> list[int]:
    """The child processes of `pid`, as its threads list them in /proc (empty once it is gone)."""
    found = []
    for tid in threads_of(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def threads_of(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def thread_sched(pid: int, tid: int) -> dict | None:
    """A thread's CPU seconds, run-queue wait seconds and involuntary context switches (None: gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            on_cpu_ns, wait_ns, _ = (int(x) for x in f.read().split())
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            preempted = next(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt_switches"))
    except (OSError, ValueError, StopIteration):
        return None
    return {"cpu_s": on_cpu_ns / 1e9, "runqueue_wait_s": wait_ns / 1e9, "preempted": preempted}


def snapshot(root_pid: int) -> dict[int, dict]:
    """Per process under `root_pid` (and itself): its main thread's and all its threads' totals."""
    out = {}
    for pid in [root_pid, *descendants(root_pid)]:
        per_thread = {tid: s for tid in threads_of(pid) if (s := thread_sched(pid, tid)) is not None}
        main = per_thread.get(pid)  # (one read for both totals)
        if main is None:
            continue
        total = {k: sum(s[k] for s in per_thread.values()) for k in main}
        out[pid] = {"threads": len(per_thread), "main": main, "all": total}
    return out


def engine_pid(root_pid: int) -> int | None:
    """The engine process under a launched server: the descendant with the most threads."""
    below = [(len(threads_of(p)), p) for p in descendants(root_pid)]
    return max(below)[1] if below else None


def delta(before: dict[int, dict], after: dict[int, dict], seconds: float, engine: int | None) -> dict:
    """Per process present in both snapshots, per wall second of the interval: CPU, run-queue wait
    and involuntary switches of its main thread and of all its threads; the engine's marked."""
    rows = {}
    for pid, now in after.items():
        then = before.get(pid)
        if then is None or seconds <= 0:
            continue
        rows[str(pid)] = {"engine": pid == engine, "threads": now["threads"]} | {
            f"{part}_{key}_per_s": (now[part][key] - then[part][key]) / seconds
            for part in ("main", "all") for key in now[part]}
    return rows
