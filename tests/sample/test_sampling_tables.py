"""Host-side sampler helpers and the per-slot device tables, against plain numpy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.engine.output import Logprob
from mrv2_jax.engine.output_processor import OutputProcessor
from mrv2_jax.engine.request_checks import check_request_fits
from mrv2_jax.runner.step_result import TokenLogprobs
from mrv2_jax.sample import SamplerFeatures, SamplingTable, SamplingTensors, sampling_row, slot_state
from mrv2_jax.sample.penalties import PenaltyData, apply_penalties, pack_token_mask, unpack_token_mask
from mrv2_jax.sample.tensors import needed_features, row_needs, seed_to_int32
from mrv2_jax.sampling_params import SamplingParams

# The jnp functions under test as one program each (op by op, every op compiles its own); host
# arrays go in as numpy (jnp.asarray(numpy) compiles a program per shape).
pack = jax.jit(pack_token_mask)
unpack = jax.jit(unpack_token_mask, static_argnums=1)
batch_inputs = jax.jit(slot_state.batch_inputs)
penalize = jax.jit(apply_penalties)
count_sampled = jax.jit(slot_state.count_sampled)


def test_sampling_row_values():
    rng = np.random.default_rng(0)
    greedy = sampling_row(SamplingParams(temperature=0.0, top_k=5, logprobs=2), seed_rng=rng)
    assert greedy.scalars["temperature"] == 0.0 and greedy.scalars["seeds"] == 0
    assert greedy.scalars["top_k"] == 5 and greedy.scalars["num_logprobs"] == 2
    unseeded = sampling_row(SamplingParams(temperature=0.7), seed_rng=rng)
    assert unseeded.scalars["seeds"] != 0 and unseeded.scalars["num_logprobs"] == -1
    assert not unseeded.uses_penalties and not unseeded.uses_sparse
    row = sampling_row(SamplingParams(min_tokens=3, stop_token_ids=[9, 4], logit_bias={7: 1.5},
                                      presence_penalty=0.5), eos_token_ids=(2,))
    assert row.stop_ids.tolist() == [2, 4, 9] and row.bias_ids.tolist() == [7]
    assert row.uses_penalties and row.uses_sparse
    ignore = sampling_row(SamplingParams(min_tokens=3, stop_token_ids=[9], ignore_eos=True), eos_token_ids=(2,))
    assert ignore.stop_ids.tolist() == [9]
    assert sampling_row(SamplingParams(stop_token_ids=[9]), eos_token_ids=(2,)).stop_ids.size == 0


def test_seeds_map_to_int32_keeping_small_seeds():
    assert seed_to_int32(1234) == 1234
    assert seed_to_int32(2**32 + 5) == 5
    assert np.int32(seed_to_int32(2**31)).view(np.uint32) == 2**31
    assert np.int32(seed_to_int32(-1)).view(np.uint32) == 2**32 - 1


def test_check_request_fits():
    check_request_fits(SamplingParams(logit_bias={5: 1.0}, stop_token_ids=[3], min_tokens=1), 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_request_fits(SamplingParams(logit_bias={10: 1.0}), 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_request_fits(SamplingParams(stop_token_ids=[12]), 10)
    with pytest.raises(ValueError, match="at most 2"):
        check_request_fits(SamplingParams(logit_bias={i: 1.0 for i in range(3)}), 10, max_bias=2)
    with pytest.raises(ValueError, match="at most 3"):
        check_request_fits(SamplingParams(stop_token_ids=[1, 2, 3, 4], min_tokens=1), 10, max_stop=4)


def test_table_gather_pads_with_neutral_rows_and_needed_features():
    table = SamplingTable(4, max_bias=3, max_stop=2)
    table.write(2, sampling_row(SamplingParams(temperature=0.5, top_p=0.9, logit_bias={1: 2.0}, seed=7)),
                num_output_tokens=3)
    t = table.gather(np.array([2]), 3)
    neutral = SamplingTensors.neutral(3, 3, 2)
    assert t.temperature.tolist() == [0.5, 0, 0] and t.top_p.tolist() == pytest.approx([0.9, 1, 1])
    assert t.bias_ids.tolist() == [[1, -1, -1]] + neutral.bias_ids[1:].tolist()
    assert t.seeds[0] == 7 and t.num_output_tokens[0] == 3
    assert table.gather_scalars(np.array([2]), 2)["repetition_penalty"].tolist() == [1, 1]
    needed = needed_features(t, vocab_size=50)
    assert needed == SamplerFeatures(sampling=True, logit_bias=True, top_p=True, runtime_skip=False)
    assert SamplerFeatures.all().covers(needed) and not SamplerFeatures().covers(needed)
    assert not SamplerFeatures.all(num_logprobs=2).covers(needed.replace(num_logprobs=5))
    assert needed_features(SamplingTensors.neutral(2), 50) == SamplerFeatures(sampling=False, runtime_skip=False)


def test_row_needs_is_the_one_row_needed_features():
    """Per request (what the V2 runner keeps) as per batch (V1's table gather), for random
    parameter sets; a greedy row needs no truncation."""
    rng = np.random.default_rng(3)
    table = SamplingTable(1, max_bias=3, max_stop=3)
    for _ in range(200):
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 5, 50])),
            top_p=float(rng.choice([1.0, 0.9])), min_p=float(rng.choice([0.0, 0.1])),
            presence_penalty=float(rng.choice([0.0, 0.5])), logit_bias={3: 1.0} if rng.random() < 0.3 else None,
            min_tokens=int(rng.choice([0, 2])), logprobs=[None, 0, 3][rng.integers(3)], seed=1)
        row = sampling_row(params, eos_token_ids=(2,))
        table.write(0, row)
        batch = needed_features(table.gather(np.array([0]), 1), vocab_size=50)
        if params.temperature == 0:
            batch = batch.replace(min_p=False, top_k=False, top_p=False)
        assert row_needs(row, vocab_size=50) == batch, params
    assert row_needs(sampling_row(SamplingParams(temperature=1.0, seed=1)), 50) == SamplerFeatures.plain_sampling()


def test_prompt_mask_packing_round_trips():
    mask = np.random.default_rng(1).random((3, 70)) < 0.3
    words = pack_token_mask(mask, np)
    assert words.shape == (3, 3) and words.dtype == np.uint32
    np.testing.assert_array_equal(unpack(words, 70), mask)
    np.testing.assert_array_equal(pack(mask), words)


@pytest.mark.parametrize("max_model_len", [None, 2048])
def test_slot_tables_write_count_and_gather(max_model_len):
    v, slots = 50, 3
    state = slot_state.init_slot_state(slots, v, max_bias=4, max_stop=2, max_model_len=max_model_len)
    assert state.output_counts.dtype == (jnp.int32 if max_model_len is None else jnp.uint16)
    writer = slot_state.SlotStateWriter(state, chunk=8)  # a 20-token history takes 3 writes
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, v, 20).tolist()
    row = sampling_row(SamplingParams(repetition_penalty=1.3, logit_bias={4: -1.0}, min_tokens=2),
                       eos_token_ids=(0,))
    state, owns = writer.write(state, 1, row, tokens, num_prompt_tokens=12)
    assert owns
    state, owns = writer.write(state, 2, sampling_row(SamplingParams()), tokens, 12)
    assert not owns
    counts = np.asarray(state.output_counts)
    np.testing.assert_array_equal(counts[1], np.bincount(tokens[12:], minlength=v))
    np.testing.assert_array_equal(np.asarray(unpack(np.asarray(state.prompt_mask)[1], v)),
                                  np.isin(np.arange(v), tokens[:12]))
    # A new request in the same slot starts from a clean row.
    state, _ = writer.write(state, 1, row, [5, 6], num_prompt_tokens=2)
    assert np.asarray(state.output_counts)[1].sum() == 0
    # The step bumps counts only for rows that own their table rows.
    state = count_sampled(state, np.array([1, -1, 1], np.int32), np.array([9, 9, 3], np.int32))
    assert np.asarray(state.output_counts)[1][[9, 3]].tolist() == [1, 1]
    assert np.asarray(state.output_counts)[2].sum() == 0
    t, pen = batch_inputs(state, SamplingTensors.neutral(2, 0, 0, xp=jnp), np.array([1, -1], np.int32))
    assert np.asarray(t.bias_ids).tolist() == [[4, -1, -1, -1], [-1] * 4]
    assert np.asarray(t.stop_ids).tolist() == [[0, -1], [-1, -1]]
    assert np.asarray(pen.rows).tolist() == [1, 0]


class _Tokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def test_logprob_dicts_keep_the_sampled_token_first():
    proc = OutputProcessor(_Tokenizer())
    entry = TokenLogprobs(token_ids=[7, 3, 7], logprobs=[-1.5, -0.5, -1.5], ranks=[2, 1, 2])
    d = proc._logprob_dict(entry)
    assert list(d) == [7, 3]
    assert d[7] == Logprob(-1.5, 2, "<7>") and d[3] == Logprob(-0.5, 1, "<3>")


def test_counts_are_narrow_only_when_no_count_can_wrap():
    assert slot_state.counts_dtype(65_535) == jnp.uint16
    assert slot_state.counts_dtype(65_536) == jnp.int32
    # The largest count a u16 table must hold, reached by repeated in-step bumps, stays exact and
    # penalises exactly as the same count in an i32 table.
    state = slot_state.init_slot_state(1, 8, max_bias=1, max_stop=1, max_model_len=65_535)
    counts = np.array(state.output_counts)
    counts[0, 3] = 65_534
    state = count_sampled(state._replace(output_counts=jax.device_put(counts)), np.array([0], np.int32),
                          np.array([3], np.int32))
    assert int(np.asarray(state.output_counts)[0, 3]) == 65_535
    t = dataclasses.replace(SamplingTensors.neutral(1, 1, 1), frequency_penalty=np.array([1e-3], np.float32))
    logits = np.zeros((1, 8), np.float32)
    wide = PenaltyData(np.asarray(state.output_counts).astype(np.int32), state.prompt_mask, np.zeros(1, np.int32))
    narrow = PenaltyData(state.output_counts, state.prompt_mask, np.zeros(1, np.int32))
    np.testing.assert_array_equal(penalize(logits, t, narrow), penalize(logits, t, wide))
    assert float(np.asarray(penalize(logits, t, narrow))[0, 3]) == pytest.approx(-65.535, rel=1e-6)
