"""The default XLA flags and GPU allocator: added when absent, never overriding what the user set."""

import os
import subprocess
import sys

import pytest

from mrv2_jax.xla_flags import apply_default_xla_flags, prefer_vmm_allocator


def test_default_flags_are_added_only_when_absent(monkeypatch):
    monkeypatch.delenv("MRV2_DEFAULT_XLA_FLAGS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == ("--xla_dump_to=/tmp/x --xla_gpu_memory_limit_slop_factor=10000 "
                                       "--xla_gpu_enable_command_buffer=+WHILE "
                                       "--xla_gpu_enable_dynamic_slice_fusion=true "
                                       "--xla_cmd_buffer_trace_cache_size=64")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")  # the user turned them off
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == ("--xla_gpu_enable_command_buffer= --xla_gpu_memory_limit_slop_factor=10000 "
                                       "--xla_gpu_enable_dynamic_slice_fusion=true "
                                       "--xla_cmd_buffer_trace_cache_size=64")
    # MRV2_DEFAULT_XLA_FLAGS=0 leaves out the performance flags, not the correctness one ...
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("MRV2_DEFAULT_XLA_FLAGS", "0")
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_memory_limit_slop_factor=10000"
    # ... which a user's own value replaces.
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_memory_limit_slop_factor=95")
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_memory_limit_slop_factor=95"


def environment_without_an_allocator_choice() -> dict[str, str]:
    """This process's environment for a child, less the variables that choose its allocator."""
    return {name: value for name, value in os.environ.items()
            if name not in ("XLA_PYTHON_CLIENT_ALLOCATOR", "MRV2_DEFAULT_XLA_FLAGS")}


def test_the_vmm_allocator_for_one_device_unless_the_user_chose_one(monkeypatch):
    monkeypatch.delenv("MRV2_DEFAULT_XLA_FLAGS", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    prefer_vmm_allocator(2)  # several devices keep JAX's pool
    assert "XLA_PYTHON_CLIENT_ALLOCATOR" not in os.environ
    prefer_vmm_allocator(1)
    assert os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] == "vmm"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "bfc")  # the user's choice wins
    prefer_vmm_allocator(1)
    assert os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] == "bfc"
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR")
    monkeypatch.setenv("MRV2_DEFAULT_XLA_FLAGS", "0")
    prefer_vmm_allocator(1)
    assert "XLA_PYTHON_CLIENT_ALLOCATOR" not in os.environ


def test_an_engine_on_one_device_asks_for_the_vmm_allocator_before_jax_starts():
    # A fresh process: JAX reads the variable when its backend starts, so the engine must set it
    # before anything it does starts the backend (resolving the kernels does).
    env = environment_without_an_allocator_choice()
    code = """
import os
from jax._src import xla_bridge
from mrv2_jax import envs, LLM
set_allocator = envs.set_xla_allocator
def set_and_say(allocator):
    print("backend started before the allocator was set:", xla_bridge.backends_are_initialized())
    set_allocator(allocator)
envs.set_xla_allocator = set_and_say
LLM("demo", max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks=16, max_model_len=128, show_progress=False)
print("allocator:", os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"])
"""
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[-2:] == ["backend started before the allocator was set: False", "allocator: vmm"]


def test_step_compiler_options_pick_cublas_unless_weights_are_fp8(monkeypatch):
    import jax.numpy as jnp

    from mrv2_jax.xla_flags import step_compiler_options

    monkeypatch.delenv("MRV2_DEFAULT_XLA_FLAGS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    bf16 = [jnp.zeros((2, 2), jnp.bfloat16), jnp.zeros((2,), jnp.float32)]
    assert step_compiler_options(bf16, "gpu") == {"xla_gpu_enable_triton_gemm": False}
    assert step_compiler_options(bf16, "cpu") == {}
    # An FP8 linear needs the Triton GEMM that fuses its dequantisation.
    assert step_compiler_options([*bf16, jnp.zeros((2, 2), jnp.float8_e4m3fn)], "gpu") == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")  # the user's choice wins
    assert step_compiler_options(bf16, "gpu") == {}
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("MRV2_DEFAULT_XLA_FLAGS", "0")
    assert step_compiler_options(bf16, "gpu") == {}


@pytest.mark.gpu
@pytest.mark.parametrize("chosen, pooled", [(None, False), ("bfc", True)])
def test_an_engine_on_one_gpu_starts_jax_on_the_allocator_asked_for(chosen, pooled):
    # A fresh process, so that the engine is what starts JAX's backend. JAX's best-fit pool reports a
    # memory limit among its stats; the VMM allocator keeps none.
    env = environment_without_an_allocator_choice()
    if chosen:
        env["XLA_PYTHON_CLIENT_ALLOCATOR"] = chosen
    code = ("import jax; from mrv2_jax import LLM; "
            "LLM('demo', max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks=16, max_model_len=128, "
            "show_progress=False); print('limit', bool((jax.devices()[0].memory_stats() or {}).get('bytes_limit')))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["limit", str(pooled)]
