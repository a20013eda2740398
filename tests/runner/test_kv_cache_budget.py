"""Sizing the KV cache from the device's memory figures (runner/kv_cache.py num_blocks_for_budget,
runner/device_memory.py)."""

import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.runner import device_memory, kv_cache

GiB = 1 << 30


class _ModelState:
    """4 KiB of KV per token, whatever the dtype."""

    def kv_bytes_per_token(self, dtype):
        return 4096


class _Device:
    platform, device_kind, local_hardware_id = "gpu", "Some GPU", 0

    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def _blocks_on(monkeypatch, stats, utilization=0.5, driver=None, live=3 * GiB):
    """Blocks on a GPU with these allocator stats, CUDA driver figures (free, total; None: no driver)
    and bytes of live arrays."""
    monkeypatch.setattr(jax, "local_devices", lambda: [_Device(stats)])
    monkeypatch.setattr(device_memory, "cuda_free_and_total", lambda ordinal: driver)
    monkeypatch.setattr(device_memory, "bytes_of_live_arrays", lambda device: live)
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


@pytest.mark.parametrize("stats", [None, {}, {"bytes_in_use": GiB}])
def test_without_allocator_stats_the_cuda_drivers_figures_size_the_cache(monkeypatch, stats):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1")
    # 16 GiB x 0.5 = 8 GiB, less the 3 GiB of live arrays and the 2 GiB reserve: 3 GiB of 64 KiB blocks.
    # The driver's free figure (here 1 GiB: memory freed, not yet given back) does not count.
    assert _blocks_on(monkeypatch, stats, driver=(1 * GiB, 16 * GiB)) == 49152


def test_live_arrays_are_counted_on_their_device(monkeypatch):
    # jax.live_arrays() is the process's; other tests' engine threads may add to it meanwhile, so the
    # count is checked on a fixed set of real arrays.
    device = jax.local_devices()[0]
    arrays = [jax.device_put(np.ones((1024, 256), np.float32), device), jax.device_put(np.ones(8, np.int8), device)]
    monkeypatch.setattr(jax, "live_arrays", lambda: arrays)
    assert device_memory.bytes_of_live_arrays(device) == (1 << 20) + 8
    assert device_memory.bytes_of_live_arrays(object()) == 0  # no shard on another device is counted


@pytest.mark.parametrize("fraction, blocks", [("", 114688), ("0.875", 147456)])
def test_from_the_driver_the_budget_is_jaxs_share_of_the_device(monkeypatch, fraction, blocks):
    # The VMM allocator refuses allocations past XLA_PYTHON_CLIENT_MEM_FRACTION (JAX: 0.75) of the device.
    # 32 GiB x fraction x 0.5, less 3 GiB in use and the 2 GiB reserve, in 64 KiB blocks.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    assert _blocks_on(monkeypatch, None, driver=(29 * GiB, 32 * GiB)) == blocks


def test_a_small_memory_fraction_leaves_no_room_for_the_cache(monkeypatch):
    # 32 GiB x 0.25 x 0.5 = 4 GiB, less 3 GiB in use and the 2 GiB reserve: nothing.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.25")
    with pytest.raises(ValueError, match="no memory left"):
        _blocks_on(monkeypatch, None, driver=(29 * GiB, 32 * GiB))


@pytest.mark.parametrize("fraction", ["abc", "0", "1.5"])
def test_a_bad_memory_fraction_is_named(monkeypatch, fraction):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        _blocks_on(monkeypatch, None, driver=(29 * GiB, 32 * GiB))


def test_the_allocators_stats_win_over_the_driver(monkeypatch):
    stats = {"bytes_limit": 16 * GiB, "bytes_in_use": 2 * GiB}
    assert _blocks_on(monkeypatch, stats, driver=(1 * GiB, 80 * GiB)) == 65536


@pytest.mark.gpu
def test_the_cuda_driver_reports_the_memory_nvidia_smi_reports():
    # nvidia-smi ships with the NVIDIA driver, so a GPU run has it: no skip.
    device = jax.local_devices()[0]
    free, total = device_memory.cuda_free_and_total(device.local_hardware_id)
    # Every GPU's row: nvidia-smi numbers them in PCI order, CUDA (and CUDA_VISIBLE_DEVICES) may not.
    query = ["nvidia-smi", "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"]
    rows = [[int(x) << 20 for x in line.split(",")] for line in subprocess.check_output(query, text=True).splitlines()]
    # nvidia-smi counts the few hundred MiB the driver reserves for itself, which the driver API leaves out.
    assert any(0 <= smi_total - total < 1 << 30 and abs((total - free) - smi_used) < 1 << 30
               for smi_total, smi_used in rows), (free, total, rows)
