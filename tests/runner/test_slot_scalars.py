"""A slot's scalars as columns of two tables (runner/device_state.py `SlotScalars`) against a plain
dict of numpy columns: whole rows put for new requests (neutral where not given, out-of-range slots
dropped), single columns set at some slots, and rows gathered by a batch's slots."""

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.runner.device_state import FLOAT_COLUMNS, INT_COLUMNS, SAMPLING_FIELDS, SlotScalars
from mrv2_jax.sample.tensors import SamplingTensors

S = 6
# A fresh slot: greedy sampling (the sampler's neutral row), no counts, no sampler tables.
NEUTRAL = {name: np.asarray(getattr(SamplingTensors.neutral(1), name))[0] for name in SAMPLING_FIELDS}
NEUTRAL |= {"num_tokens": 0, "prefill_len": 0, "num_computed": 0, "num_prompt": 0, "sampler_row": -1}


def columns(scalars: SlotScalars) -> dict[str, np.ndarray]:
    return {name: np.asarray(scalars[name]) for name in INT_COLUMNS + FLOAT_COLUMNS}


def test_rows_and_columns_match_a_dict_of_columns():
    rng = np.random.default_rng(0)
    reference = {name: np.full(S, NEUTRAL[name], np.float32 if name in FLOAT_COLUMNS else np.int32)
                 for name in INT_COLUMNS + FLOAT_COLUMNS}
    scalars = SlotScalars.neutral(S)
    for name, column in columns(scalars).items():
        np.testing.assert_array_equal(column, reference[name], err_msg=name)
    assert scalars.ints.dtype == jnp.int32 and scalars.floats.dtype == jnp.float32
    put_rows, set_at = jax.jit(SlotScalars.put_rows), jax.jit(SlotScalars.set_at, static_argnums=1)
    for _ in range(5):
        # New requests in two slots and one unused entry (slot S: dropped), some columns given.
        slots = np.append(rng.choice(S, 2, replace=False), S).astype(np.int32)
        given = {"num_tokens": rng.integers(1, 50, 3).astype(np.int32), "temperature": rng.random(3).astype(np.float32),
                 "top_k": rng.integers(0, 9, 3).astype(np.int32), "sampler_row": -1}
        scalars = put_rows(scalars, jnp.asarray(slots), given)
        for i, slot in enumerate(slots[:2]):
            for name in reference:
                value = given.get(name, NEUTRAL[name])
                reference[name][slot] = value if np.ndim(value) == 0 else value[i]
        # One column set at some slots (an out-of-range one dropped), as a step's post-update does.
        name = str(rng.choice(["num_computed", "num_tokens", "automaton_state", "top_p"]))
        at = np.array([rng.integers(S), S], np.int32)
        values = rng.integers(0, 100, 2).astype(reference[name].dtype)
        scalars = set_at(scalars, name, jnp.asarray(at), jnp.asarray(values))
        reference[name][at[0]] = values[0]
        for column_name, column in columns(scalars).items():
            np.testing.assert_array_equal(column, reference[column_name], err_msg=column_name)
    batch = np.array([3, 0, 3], np.int32)
    for name, column in columns(scalars.rows(jnp.asarray(batch))).items():
        np.testing.assert_array_equal(column, reference[name][batch], err_msg=name)
