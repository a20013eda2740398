"""The engine's record of a step's hand-over to its runner splits the host seconds into the engine
thread's CPU time and the rest (off the CPU): a runner that works for a known CPU time and then
sleeps for a known wall time must read back as both."""

import time

from benchmarks.host_step import build
from mrv2_jax.engine.request import Request
from mrv2_jax.sampling_params import SamplingParams

WORK_S, SLEEP_S = 0.03, 0.04
PYTHON_S = 0.03  # the second test's runner Python, slept outside the compiled call


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
    assert seen[0].prefill_tokens > 0 and [d.prefill_tokens for d in seen[1:]] == [0, 0]  # the prompt, two decodes
    for d in seen:
        assert WORK_S <= d.cpu_s < WORK_S + 0.02
        assert d.seconds - d.cpu_s >= SLEEP_S
        assert d.call_s == 0.0  # the stand-in runner makes no compiled calls


def test_a_hand_over_counts_the_runners_compiled_calls_apart():
    """The real V2 runner (the tiny test model): host time inside its compiled step programs is
    counted as the calls', time in the runner's Python around them is not."""
    from tests.engine.test_engine import make_llm

    engine = make_llm(runner="v2", max_num_seqs=2, max_fused_steps=1).engine
    runner = engine.runner
    execute = runner.execute

    def slow(program):
        def called(*args):
            time.sleep(SLEEP_S)  # host time of the program's call
            return program(*args)
        return called

    for bucket, (layout, variants) in list(runner.compiled.items()):
        runner.compiled[bucket] = (layout, [slow(v) for v in variants])

    def python_then_execute(out):
        time.sleep(PYTHON_S)  # host time of the runner's own, outside any call
        return execute(out)

    engine.runner.execute = python_then_execute
    engine.add_request(Request("r", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    seen = []
    while engine.has_work():
        engine.step()
        if engine.dispatched is not None:
            seen.append(engine.dispatched)
    assert len(seen) == 3
    for d in seen:
        assert SLEEP_S <= d.call_s < SLEEP_S + 0.03  # one program call per step
        assert d.seconds - d.call_s >= PYTHON_S
