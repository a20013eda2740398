"""The command line: the README's main command, run as a user would (a subprocess), and engine flags."""

import subprocess
import sys

import pytest


def test_generate_command_prints_text_from_the_demo_model():
    prompt = "The king said"
    # generate's one-row engine with one 8-token bucket (the prompt fits): 2 step programs to compile, not 7.
    run = subprocess.run([sys.executable, "-m", "mrv2_jax.entrypoints.cli", "generate", "--prompt", prompt,
                          "--max-tokens", "24", "--max-num-batched-tokens", "8"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(prompt)
    generated = run.stdout[len(prompt):].strip()
    assert len(generated) >= 20
    # Recognisable text, not byte noise: mostly letters and spaces.
    assert sum(c.isalpha() or c.isspace() for c in generated) / len(generated) > 0.8


def test_unknown_model_is_a_clear_error():
    run = subprocess.run([sys.executable, "-m", "mrv2_jax.entrypoints.cli", "generate", "--prompt", "x",
                          "--model", "no-such-model"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "no-such-model" in run.stderr


def test_kernels_flag_parses_into_the_engine_kernel_config(monkeypatch):
    """`--kernels field=value,...` sets KernelConfig fields over the environment's defaults, and
    EngineConfig resolves "auto" for the backend; a bad field or value is a clear error."""
    from mrv2_jax.config import KernelConfig
    from mrv2_jax.engine.engine_config import EngineConfig
    from mrv2_jax.entrypoints.cli import build_parser, engine_kwargs

    monkeypatch.setenv("MRV2_MOE_BACKEND", "dense")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--kernels",
                                      "attention=pallas, sampler_slow_path=interpret"])
    kernels = EngineConfig(**engine_kwargs(args)).kernels
    assert kernels == KernelConfig(attention="pallas", sampler_logit_stats="reference", sampler_noise_pass="reference",
                                   sampler_slow_path="interpret", moe_backend="dense",
                                   decode_attention="pallas", ragged_attention="pallas",
                                   sampler_truncation="threshold", decode_projections="xla")  # the CPU's resolution
    for bad, named in (("attention=fast", "KernelConfig.attention"), ("sampler=kernel", "unknown kernel fields"),
                       ("attention", "field=value")):
        args = build_parser().parse_args(["generate", "--prompt", "x", "--kernels", bad])
        with pytest.raises(ValueError, match=named):
            EngineConfig(**engine_kwargs(args))


def test_bucket_token_sizes_flag_parses_into_the_engine_config():
    from mrv2_jax.engine.engine_config import EngineConfig
    from mrv2_jax.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "--prompt", "x", "--max-num-batched-tokens", "64",
                                      "--bucket-token-sizes", "64", "16"])
    assert EngineConfig(**engine_kwargs(args)).bucket_token_sizes == (16, 64)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--bucket-token-sizes", "8"])  # budget 2048
    with pytest.raises(ValueError, match="bucket_token_sizes must end at max_num_batched_tokens"):
        EngineConfig(**engine_kwargs(args))
