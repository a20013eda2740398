"""The engine's record of a step's hand-over to its runner splits the host seconds into the engine
thread's CPU time and the rest (off the CPU): a runner that works for a known CPU time and then
sleeps for a known wall time must read back as both."""

import time

from benchmarks.host_step import build
from mrv2_jax.engine.request import Request
from mrv2_jax.sampling_params import SamplingParams

WORK_S, SLEEP_S = 0.03, 0.04


def test_a_hand_over_splits_into_cpu_and_off_cpu_time():
    engine = build(rows=1, prompt_len=8, max_tokens=3, streaming=False)
    execute = engine.runner.execute

    def working_then_sleeping(out):
        start = time.thread_time()
        while time.thread_time() - start < WORK_S:  # CPU time of this thread, however it was scheduled
            pass
        time.sleep(SLEEP_S)
        return execute(out)

    engine.runner.execute = working_then_sleeping
    engine.add_request(Request("r", list(range(8)), SamplingParams(max_tokens=3, ignore_eos=True)))
    seen = []
    while engine.has_work():
        engine.step()
        if engine.dispatched is not None:
            seen.append(engine.dispatched)
    assert seen[0][1] > 0 and [prefill for _, prefill, _ in seen[1:]] == [0, 0]  # the prompt, two decode steps
    for wall_s, _, cpu_s in seen:
        assert WORK_S <= cpu_s < WORK_S + 0.02
        assert wall_s - cpu_s >= SLEEP_S
