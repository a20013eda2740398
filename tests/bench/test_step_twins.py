"""benchmarks.step_twins: its split of the steps that add KV blocks (one in every block_size steps for
one decoding row)."""

from benchmarks.step_twins import main


def test_one_row_adds_a_kv_block_once_in_block_size_steps():
    steps, rounds, block_size = 32, 2, 8
    results = main(["--model", "demo", "--rows", "1", "--input-len", "8", "--steps", str(steps), "--warm-steps", "2",
                    "--rounds", str(rounds), "--arms", "plain", "--max-model-len", "256",
                    "--block-size", str(block_size)])["results"]
    plain = results["plain"]
    assert plain["steps"] == steps * rounds
    # The row grows by one token a step, so every block_size-th step takes a new block (give or take
    # the steps at either end of a measured stretch).
    assert abs(plain["steps_new_blocks"] - steps * rounds / block_size) <= rounds
    assert 0 < plain["call_ms"] <= plain["call_p90_ms"] and results["twins_made"] == 0
