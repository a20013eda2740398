"""A step program takes the SlotState's tables read only: its call donates and replaces the
penalty counts, and leaves the bias, stop and prompt-mask tables and the automaton pool where they
are (runner/base.py, `reading_slot_tables`)."""

import jax
import numpy as np
import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.runner.base import reading_slot_tables
from mrv2_jax.sample import slot_state
from mrv2_jax.sampling_params import SamplingParams


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_step_replaces_the_counts_and_keeps_the_tables(runner):
    llm = LLM("demo", runner=runner, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64,
              num_gpu_blocks=16, sampler_variants="all", show_progress=False)
    # A penalised request writes its slot's rows, so the tables hold something to keep.
    params = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3, logit_bias={5: -2.0})
    llm.generate([[1, 2, 3, 4]], params)
    engine_runner = llm.engine.runner
    counts, tables = slot_state.split(engine_runner.slot_state)
    held = [np.asarray(a) for a in jax.tree.leaves(tables)]
    if runner == "v2":  # its programs are keyed (kind, bucket): fused decode's are among them
        assert {kind for kind, _ in engine_runner._step_programs} == {"step", "fused"}
    for layout, variants in engine_runner._step_programs.values():  # every bucket's program, on an empty batch
        engine_runner.call_step(variants[-1], engine_runner.empty_batch(layout))

        new_counts, new_tables = slot_state.split(engine_runner.slot_state)
        assert counts.is_deleted() and not new_counts.is_deleted()  # donated, and a new one returned
        assert all(a is b and not a.is_deleted()
                   for a, b in zip(jax.tree.leaves(new_tables), jax.tree.leaves(tables), strict=True))
        counts = new_counts
    for kept, before in zip(jax.tree.leaves(new_tables), held):
        np.testing.assert_array_equal(np.asarray(kept), before)
    assert np.asarray(new_tables[1]).max() == 5  # bias_ids: the request's logit bias is still there


def test_a_step_that_writes_a_table_is_rejected():
    state = slot_state.init_slot_state(2, 16, max_bias=2, max_stop=1)

    def step(param_leaves, sampler_state, packed, spec_params, spec_state):
        return sampler_state._replace(bias_ids=sampler_state.bias_ids + 1), packed, spec_state

    counts, tables = slot_state.split(state)
    with pytest.raises(ValueError, match="changed the SlotState's tables"):
        jax.eval_shape(reading_slot_tables(step), (), counts, tables, np.zeros(4, np.int32), (), ())
