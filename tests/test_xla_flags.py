"""The default XLA flags: added when absent, never overriding what the user set."""

from mrv2_jax.xla_flags import apply_default_xla_flags


def test_default_flags_are_added_only_when_absent(monkeypatch):
    monkeypatch.delenv("MRV2_DEFAULT_XLA_FLAGS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    apply_default_xla_flags()
    import os

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
