"""The scheduler stats of a process tree against the processes' own accounts: a child that starts a
grandchild with extra threads, both spinning for a known CPU time; two spinners on one CPU must
each wait in the run queue about as long as the other ran."""

import json
import os
import subprocess
import sys
import time

import pytest

from mrv2_jax.bench import sched_stats

# A child that starts a grandchild (four threads, the "engine") and then spins itself.
CHILD = """
import json, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
print(grandchild.pid, flush=True)
sys.stdin.readline()
cpu0 = time.thread_time()
t0 = time.perf_counter()
while time.perf_counter() - t0 < 0.6:
    sum(range(1000))
cpu = time.thread_time() - cpu0
print(json.dumps({"child_cpu": cpu, "grandchild": json.loads(grandchild.stdout.readline())}), flush=True)
sys.stdin.readline()  # both stay alive until the test has read them
grandchild.communicate("exit\\n")
"""
GRANDCHILD = """
import json, sys, threading, time
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(3)]
for t in threads:
    t.start()
time.sleep(0.8)
cpu0 = time.thread_time()
t0 = time.perf_counter()
while time.perf_counter() - t0 < 0.6:
    sum(range(1000))
cpu = time.thread_time() - cpu0
print(json.dumps({"cpu": cpu}), flush=True)
sys.stdin.readline()
stop.set()
"""

needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs Linux /proc schedstat")


@needs_proc
def test_a_trees_cpu_time_and_its_engine_match_the_processes_own_accounts():
    child = subprocess.Popen([sys.executable, "-c", CHILD, GRANDCHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    time.sleep(0.4)  # the grandchild's threads are up, nothing spins yet
    assert set(sched_stats.descendants(os.getpid())) >= {child.pid, grandchild}
    assert sched_stats.engine_pid(child.pid) == grandchild  # the one with the most threads
    before, t0 = sched_stats.snapshot(child.pid), time.perf_counter()
    child.stdin.write("go\n")
    child.stdin.flush()
    own = json.loads(child.stdout.readline())
    after = sched_stats.snapshot(child.pid)
    seconds = time.perf_counter() - t0
    child.communicate("exit\n", timeout=30)
    rows = sched_stats.delta(before, after, seconds, engine=grandchild)
    assert rows[str(grandchild)]["engine"] and not rows[str(child.pid)]["engine"]
    assert rows[str(grandchild)]["threads"] == 4
    child_cpu = rows[str(child.pid)]["main_cpu_s_per_s"] * seconds
    grandchild_cpu = rows[str(grandchild)]["main_cpu_s_per_s"] * seconds
    assert own["child_cpu"] - 0.05 <= child_cpu <= own["child_cpu"] + 0.15
    assert own["grandchild"]["cpu"] - 0.05 <= grandchild_cpu <= own["grandchild"]["cpu"] + 0.15
    # A process's threads together ran at least as long as its main thread.
    assert rows[str(grandchild)]["all_cpu_s_per_s"] >= rows[str(grandchild)]["main_cpu_s_per_s"] - 1e-9


SPIN = """
import sys, time
t0 = time.perf_counter()
while time.perf_counter() - t0 < float(sys.argv[1]):
    pass
"""


@needs_proc
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_two_spinners_on_one_cpu_wait_for_it():
    cpu = min(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", SPIN, "5.0"]) for _ in range(2)]
    try:
        for p in procs:
            os.sched_setaffinity(p.pid, {cpu})
        time.sleep(0.3)  # past the interpreters' start
        before = {p.pid: sched_stats.thread_sched(p.pid, p.pid) for p in procs}
        t0 = time.perf_counter()
        time.sleep(0.4)
        after = {p.pid: sched_stats.thread_sched(p.pid, p.pid) for p in procs}
        seconds = time.perf_counter() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    ran = sum(after[p]["cpu_s"] - before[p]["cpu_s"] for p in after)
    waited = sum(after[p]["runqueue_wait_s"] - before[p]["runqueue_wait_s"] for p in after)
    # Always runnable, each spinner either ran or waited for the whole interval; sharing one CPU,
    # together they ran no longer than it, so they waited at least about as long.
    assert abs(ran + waited - 2 * seconds) < 0.1
    assert ran <= seconds + 0.05 and waited >= seconds - 0.1
    assert sum(after[p]["preempted"] - before[p]["preempted"] for p in after) > 0
