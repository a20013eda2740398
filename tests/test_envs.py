"""The registry of environment switches (mrv2_jax/envs.py), the KernelConfig built from it, and
that no other module of the package reads the environment."""

import re
from pathlib import Path

import pytest

from mrv2_jax import envs
from mrv2_jax.config import KernelConfig

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = ("MRV2_RUNNER", "MRV2_COMPILATION_CACHE", "MRV2_CHECKPOINTS", "MRV2_STRICT_COMPILES",
            "MRV2_DEFAULT_XLA_FLAGS", "MRV2_API_KEY", "MRV2_SAMPLER_KERNELS", "MRV2_SAMPLER_NOISE_PASS",
            "MRV2_SAMPLER_SLOW_PATH", "MRV2_MOE_BACKEND", "MRV2_STRUCTURED_STATES",
            "MRV2_STRUCTURED_EXCEPTIONS", "MRV2_NUM_PROCESSES", "MRV2_COORDINATOR_ADDRESS",
            "MRV2_PROCESS_ID", "MRV2_GIT_SHA", "MRV2_VLLM_SITE", "MRV2_VLLM_MODEL")


def test_table_lists_every_switch_and_the_docs_hold_it():
    assert set(envs.SWITCHES) == set(EXPECTED)
    table = envs.render_markdown()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `(\w+)`", row).group(1) for row in rows] == list(envs.SWITCHES)
    assert "| `MRV2_SAMPLER_NOISE_PASS` | choice | `auto` | `auto`, `kernel`, `interpret`, `reference` |" in table
    assert table in (ROOT / "docs" / "switches.md").read_text(), "docs/switches.md: paste envs.render_markdown()"


def test_read_parses_defaults_and_values(monkeypatch):
    for name in EXPECTED:
        monkeypatch.delenv(name, raising=False)
    assert envs.read("MRV2_RUNNER") == "v2"
    assert envs.read("MRV2_STRICT_COMPILES") is False and envs.read("MRV2_DEFAULT_XLA_FLAGS") is True
    assert envs.read("MRV2_API_KEY") is None
    monkeypatch.setenv("MRV2_STRICT_COMPILES", "1")
    monkeypatch.setenv("MRV2_COMPILATION_CACHE", "~/elsewhere")
    monkeypatch.setenv("MRV2_API_KEY", "")  # empty: unset
    assert envs.read("MRV2_STRICT_COMPILES") is True
    assert envs.read("MRV2_COMPILATION_CACHE") == str(Path.home() / "elsewhere")
    assert envs.read("MRV2_API_KEY") is None
    assert envs.subprocess_env(EXTRA="1")["EXTRA"] == "1" and envs.subprocess_env()["MRV2_STRICT_COMPILES"] == "1"
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    assert envs.read_external("PYTHONPATH") == "/somewhere"
    with pytest.raises(ValueError, match="envs.read"):
        envs.read_external("MRV2_RUNNER")


@pytest.mark.parametrize("name,value,allowed", [("MRV2_SAMPLER_KERNELS", "fast", "auto, kernel, interpret, reference"),
                                                ("MRV2_RUNNER", "v3", "v1, v2"),
                                                ("MRV2_DEFAULT_XLA_FLAGS", "yes", "0, 1")])
def test_bad_values_name_the_variable_and_the_allowed_values(monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be one of {allowed}; got '{value}'"):
        envs.read(name)


def test_kernel_config_reads_its_defaults_once_and_resolves_per_backend(monkeypatch):
    monkeypatch.setenv("MRV2_SAMPLER_NOISE_PASS", "interpret")
    monkeypatch.setenv("MRV2_MOE_BACKEND", "dense")
    monkeypatch.delenv("MRV2_SAMPLER_KERNELS", raising=False)
    monkeypatch.delenv("MRV2_SAMPLER_SLOW_PATH", raising=False)
    config = KernelConfig.parse("attention=reference")
    assert config == KernelConfig(attention="reference", sampler_noise_pass="interpret", moe_backend="dense")
    assert config.resolved("gpu") == KernelConfig("reference", "kernel", "interpret", "kernel", "dense", "pallas",
                                                  "pallas", "threshold", "xla")
    # The noise pass in the interpreter: a Pallas program, so the truncation stays the threshold method.
    assert config.resolved("cpu") == KernelConfig("reference", "reference", "interpret", "reference", "dense", "pallas",
                                                  "pallas", "threshold", "xla")
    # "kernel" for a sampler pass: the kernel where it runs, the jnp reference elsewhere.
    assert KernelConfig(sampler_slow_path="kernel").resolved("cpu").sampler_slow_path == "reference"
    assert KernelConfig().resolved("gpu").attention == "pallas"
    # The truncation: the threshold method on GPUs and where a sampler piece runs in the interpreter, one
    # sort per row elsewhere; an explicit choice stands.
    assert KernelConfig().resolved("gpu").sampler_truncation == "threshold"
    assert KernelConfig().resolved("cpu").sampler_truncation == "sort"
    assert KernelConfig(sampler_slow_path="interpret").resolved("cpu").sampler_truncation == "threshold"
    assert KernelConfig(sampler_truncation="threshold").resolved("cpu").sampler_truncation == "threshold"
    assert KernelConfig(sampler_truncation="sort").resolved("gpu").sampler_truncation == "sort"
    assert KernelConfig().resolved("cpu").moe_backend == "ragged_dot"
    assert KernelConfig().resolved("gpu").moe_backend == "pallas"  # this CPU has no wgmma
    assert KernelConfig().resolved("gpu").decode_attention == "pallas"
    assert KernelConfig.parse("decode_attention=mgpu").resolved("gpu").decode_attention == "mgpu"
    with pytest.raises(ValueError, match="decode_attention must be one of auto, pallas, mgpu"):
        KernelConfig(decode_attention="triton")
    assert KernelConfig().resolved("gpu").ragged_attention == "pallas"
    assert KernelConfig.parse("ragged_attention=mgpu").resolved("gpu").ragged_attention == "mgpu"
    with pytest.raises(ValueError, match="ragged_attention must be one of auto, pallas, mgpu"):
        KernelConfig(ragged_attention="triton")


def test_moe_backend_defaults_to_mosaic_gpu_on_hopper_class_gpus(monkeypatch):
    import types

    import jax

    from pallas_kernels import mgpu_common

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for capability, has in (("9.0", True), ("8.0", False), ("10.0", False)):
        monkeypatch.setattr(jax, "devices", lambda c=capability: [types.SimpleNamespace(compute_capability=c)])
        assert mgpu_common.has_wgmma() is has
        assert KernelConfig().resolved("gpu").moe_backend == ("mgpu" if has else "pallas")
        assert KernelConfig(moe_backend="pallas").resolved("gpu").moe_backend == "pallas"
    assert KernelConfig().resolved("cpu").moe_backend == "ragged_dot"
    assert KernelConfig.parse({"moe_backend": "pallas"}).moe_backend == "pallas"
    with pytest.raises(ValueError, match="KernelConfig.sampler_slow_path must be one of auto, kernel"):
        KernelConfig(sampler_slow_path="cond")
    monkeypatch.setenv("MRV2_SAMPLER_SLOW_PATH", "cond")
    with pytest.raises(ValueError, match="MRV2_SAMPLER_SLOW_PATH"):
        KernelConfig.from_env()


def test_no_module_but_envs_reads_the_environment():
    """Every read goes through envs.py, so the registry is complete (child processes' environments
    too: envs.subprocess_env)."""
    offenders = []
    for folder in ("mrv2_jax", "pallas_kernels", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "mrv2_jax/envs.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\bos\.(environ|getenv|putenv|unsetenv)\b|\bgetenv\(|from os import .*environ", line):
                    offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "read the environment through mrv2_jax/envs.py:\n" + "\n".join(offenders)


def test_every_kernel_config_field_has_a_row_in_the_docs_table():
    doc = (ROOT / "docs" / "switches.md").read_text()
    missing = [field for field in KernelConfig.CHOICES if f"| `{field}` | `{field}=VALUE` |" not in doc]
    assert not missing, f"docs/switches.md's KernelConfig table lacks {missing}"
