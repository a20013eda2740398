"""CpuSampler against the child's own account of its CPU time: a process that sleeps and then
computes, whose last second's load the sampler must tell apart from its whole life's."""

import json
import subprocess
import sys

import pytest

from mrv2_jax.bench.process_cpu import CpuSampler, read_cpu

CHILD = """
import json, time
time.sleep(1.0)
cpu0, t0 = time.process_time(), time.perf_counter()
while time.perf_counter() - t0 < 1.5:
    sum(range(1000))
print(json.dumps({"cpu": time.process_time() - cpu0, "wall": time.perf_counter() - t0}))
"""


@pytest.mark.skipif(read_cpu(1) is None, reason="needs Linux /proc")
def test_the_last_seconds_load_is_the_childs_own_account():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    sampler = CpuSampler(proc.pid, period=0.05)
    out, _ = proc.communicate(timeout=60)
    sampler.stop()
    own = json.loads(out)
    busy = sampler.busy_over_last(own["wall"])
    assert busy is not None and abs(busy - own["cpu"] / own["wall"]) < 0.15
    assert sampler.samples[-1][1] >= own["cpu"] - 0.05  # it sampled the process to its end
    # Over a window reaching into the sleep, the load is lower than over the busy part alone.
    assert sampler.busy_over_last(own["wall"] + 0.9) < 0.8 * busy
    assert sampler.busy_over_last(1e6) is None  # longer than the process lived
