"""benchmarks.step_twins: its split of the steps that add KV blocks (one in every block_size steps for
one decoding row), and on GPUs that a step program's twin, used in turn with it, decodes what the
program alone decodes."""

import pytest

from benchmarks.step_twins import Twins, main
from mrv2_jax.llm import LLM
from mrv2_jax.sampling_params import SamplingParams


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


@pytest.mark.gpu  # XLA:CPU cannot serialize the step programs, so they have no twins there
def test_a_step_program_and_its_twin_in_turn_decode_what_the_program_alone_decodes():
    def greedy(twinned: bool):
        llm = LLM("demo", max_num_seqs=2, max_model_len=128, max_fused_steps=1, show_progress=False)
        twins = Twins(llm.engine.runner)
        twins.on = twinned
        outputs = llm.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=24, temperature=0.0,
                                                                          ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], len(twins.twins)

    alone, _ = greedy(False)
    in_turn, made = greedy(True)
    assert made > 0 and in_turn == alone
