"""benchmarks.api_process_cost's reading of a process's CPU time from /proc, against the
process's own account of it (os.times)."""

import os

from benchmarks.api_process_cost import cpu_seconds


def test_cpu_seconds_of_this_process():
    sum(i * i for i in range(2_000_000))  # some CPU time of our own
    times = os.times()
    assert abs(cpu_seconds(os.getpid()) - (times.user + times.system)) < 0.05
