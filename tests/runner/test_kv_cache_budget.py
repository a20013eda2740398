"""Sizing the KV cache from the device's memory stats (runner/kv_cache.py num_blocks_for_budget)."""

import jax
import jax.numpy as jnp
import pytest

from mrv2_jax.runner import kv_cache

GiB = 1 << 30


class _ModelState:
    """4 KiB of KV per token, whatever the dtype."""

    def kv_bytes_per_token(self, dtype):
        return 4096


class _Device:
    platform, device_kind = "gpu", "Some GPU"

    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def _blocks_on(monkeypatch, stats, utilization=0.5):
    monkeypatch.setattr(jax, "local_devices", lambda: [_Device(stats)])
    return kv_cache.num_blocks_for_budget(_ModelState(), 16, jnp.bfloat16, utilization)


def test_the_cpu_gets_a_small_fixed_pool():
    assert jax.local_devices()[0].platform == "cpu"
    assert kv_cache.num_blocks_for_budget(_ModelState(), 16, jnp.bfloat16, 0.9) == 1024


def test_blocks_fill_the_budget_left_after_weights_and_reserve(monkeypatch):
    # 16 GiB x 0.5 = 8 GiB, less 2 GiB in use and the 2 GiB reserve: 4 GiB of 64 KiB blocks (4 KiB x 16 tokens).
    assert _blocks_on(monkeypatch, {"bytes_limit": 16 * GiB, "bytes_in_use": 2 * GiB}) == 65536


def test_a_budget_without_room_for_one_block_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        _blocks_on(monkeypatch, {"bytes_limit": 8 * GiB, "bytes_in_use": 2 * GiB})


@pytest.mark.parametrize("stats", [None, {}, {"bytes_in_use": GiB}])
def test_an_accelerator_without_a_memory_limit_asks_for_num_gpu_blocks(monkeypatch, stats):
    with pytest.raises(ValueError, match="num-gpu-blocks"):
        _blocks_on(monkeypatch, stats)
