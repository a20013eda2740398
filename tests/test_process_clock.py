"""process_age_s counts from the process's start, interpreter start and imports included: a child
that sleeps before asking reports at least that sleep and at most the parent's wall clock."""

import subprocess
import sys
import time


def test_a_process_knows_its_age():
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.6); "
                          "from mrv2_jax.process_clock import process_age_s; print(process_age_s())"],
                         capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    age = float(out.stdout.split()[-1])
    assert 0.6 <= age <= wall + 0.02  # /proc counts in 10 ms ticks
