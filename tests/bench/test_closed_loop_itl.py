"""benchmarks/closed_loop_itl.py: its gap accounting on a schedule worked out by hand, and its
closed-loop driver on the demo model against the plain greedy loop (tests/engine_reference.py)."""

import pytest

from benchmarks.closed_loop_itl import after_step_periods, classify_gaps, drive
from mrv2_jax.sampling_params import SamplingParams


def test_gaps_are_split_by_the_steps_inside_them():
    # Calls start every 1 s; the one at 2 s scheduled a prompt (3 tokens for 2 rows), the others decode.
    steps = [(float(t), t + 0.9, 3 if t == 2 else 2, 2) for t in range(7)]
    # A stream whose outputs come back 0.1 s after each call starts, tokens 1..6.
    arrivals = {"a": [(t + 0.1, t) for t in range(1, 7)]}
    got = classify_gaps(arrivals, steps)
    # Gaps 1.1-2.1 (the admitting call started inside it) and 2.1-3.1 (it started last before the
    # gap: with async scheduling its output comes back in this one) span it; 3.1-4.1 ... 5.1-6.1 do not.
    assert sorted(round(g, 6) for g in got["admit_gaps"]) == [1.0, 1.0]
    assert [round(g, 6) for g in got["decode_gaps"]] == [1.0, 1.0, 1.0]
    assert got["tpots"] == [pytest.approx(5.0 / 5)]
    after_admit, after_decode = after_step_periods(steps)
    assert after_admit == [1.0] and len(after_decode) == 4  # the call at 3 s waits on the one at 2 s


def test_streams_of_a_closed_loop_get_the_tokens_of_a_plain_loop():
    from mrv2_jax.models.loader import CHECKPOINTS_DIR
    from tests.engine.test_engine import demo_llm
    from tests.engine_reference import greedy_reference

    llm = demo_llm()
    prompts = [[5 + i, 96, 17 + 3 * i, 40] for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    arrivals, finals = drive(llm, prompts, params, concurrency=2)
    assert len(arrivals) == 5 and all(points[-1][1] == 12 for points in arrivals.values())
    for points in arrivals.values():  # counts only grow, arrival times only move forward
        assert all(b[0] >= a[0] and b[1] > a[1] for a, b in zip(points, points[1:]))
    assert finals == [greedy_reference(CHECKPOINTS_DIR / "demo-qwen3", p, 12) for p in prompts]
