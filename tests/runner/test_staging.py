"""The packed input's staging buffers (runner/staging.py): one per size, filled in place, never
moving between calls, and the layouts' sizes rounded so that few buffers serve all buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.runner.packed import MIN_CAPACITY, PackedLayout
from mrv2_jax.runner.staging import PackedStaging


def _step():
    """A step program's calling convention in small: state and packed buffer donated, both returned."""
    def step(total, packed):
        return total + packed[:4].sum(), packed
    return jax.jit(step, donate_argnums=(0, 1)).lower(jnp.zeros((), jnp.int32),
                                                      jax.ShapeDtypeStruct((256,), jnp.int32)).compile()


def test_the_staged_buffer_holds_each_input_and_keeps_its_address():
    staging, step = PackedStaging({256, 512}), _step()
    total, addresses, expected = jnp.zeros((), jnp.int32), set(), 0
    rng = np.random.default_rng(0)
    for i in range(5):
        packed = rng.integers(-100, 100, 256, dtype=np.int32)
        if i % 2:  # device arrays are copied in too
            packed = jax.device_put(packed)
        buffer = staging.take(packed)
        np.testing.assert_array_equal(np.asarray(buffer), np.asarray(packed))
        total, back = step(total, buffer)
        staging.give_back(back)
        expected += int(np.asarray(packed)[:4].sum())
        addresses.add(back.unsafe_buffer_pointer())
    assert int(total) == expected
    assert len(addresses) == 1, addresses  # donated and handed back: the same device buffer
    assert [b.shape[0] for b in staging.buffers()] == [256, 512]


def test_a_size_without_a_buffer_is_refused_and_a_lost_buffer_is_made_again():
    staging = PackedStaging({256})
    with pytest.raises(ValueError, match="no staging buffer holds a packed input of 300 values"):
        staging.take(np.zeros(300, np.int32))
    staging.take(np.ones(256, np.int32))  # handed out and never given back (a call that failed)
    again = staging.take(np.full(256, 7, np.int32))
    np.testing.assert_array_equal(np.asarray(again), np.full(256, 7))


def test_layout_capacity_is_a_power_of_two_that_holds_the_fields():
    for fields in ({"a": (3,)}, {"a": (200,), "b": (57,)}, {"a": (4, 300), "b": (1,)}):
        layout = PackedLayout(fields)
        assert layout.capacity >= max(layout.size, MIN_CAPACITY)
        assert layout.capacity & (layout.capacity - 1) == 0 and layout.capacity < 2 * max(layout.size, MIN_CAPACITY)
        buf = layout.empty()
        assert buf.shape == (layout.capacity,)
        for name, shape in fields.items():
            layout.view(buf, name)[...] = np.arange(int(np.prod(shape))).reshape(shape) + len(name)
        unpacked = layout.unpack(jnp.asarray(buf))
        for name, shape in fields.items():
            np.testing.assert_array_equal(np.asarray(unpacked[name]), np.arange(int(np.prod(shape))).reshape(shape) + 1)
