"""The XLA vs CUDA-graph benchmark on the CPU: the JAX arms (each its own process, one with the
command-buffer flag off) on the tiny model; the PyTorch arms are reported as skipped where torch
or CUDA is missing, and the eager one runs on the CPU when a Python with torch is given."""

import json
import os
from pathlib import Path

import pytest

from mrv2_jax.bench import xla_vs_cudagraph as bench

MODEL = str(Path(__file__).parents[1] / "fixtures" / "qwen3-tiny")
COMMON = ["--model", MODEL, "--load-format", "auto", "--dtype", "float32", "--batches", "1,3", "--context", "12",
          "--runs", "3", "--warmup", "1", "--max-num-batched-tokens", "32"]
TORCH_PYTHON = os.environ.get("MRV2_TORCH_PYTHON", "/work/.oracle-venv/bin/python")


def test_jax_arms_and_skipped_torch_arms(tmp_path):
    out = tmp_path / "x.json"
    # One JAX arm (each is a process: ~20 s on a CPU); the flagged one shows the flag reached it.
    bench.main([*COMMON, "--arms", "jax-no-cmdbuf,torch-cudagraph,torch-eager",
                "--torch-python", "/nonexistent/python", "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert {"date", "git_sha", "jax_version", "device"} <= report.keys()
    arms = report["arms"]
    assert arms["jax-no-cmdbuf"]["xla_flags"].endswith("--xla_gpu_enable_command_buffer=")
    for batch in ("1", "3"):
        r = arms["jax-no-cmdbuf"]["batches"][batch]
        assert r["sync_ms"] > 0 and r["pipelined_ms"] > 0 and r["param_bytes"] > 0
        assert r["kv_bytes"] == int(batch) * 12 * 2 * 2 * 2 * 16 * 4  # rows x ctx x (layers, K/V, heads, dim, f32)
    for arm in ("torch-cudagraph", "torch-eager"):  # no such interpreter: reported, not fatal
        assert "error" in arms[arm] or "skipped" in arms[arm]
    rows = report["table"]
    assert {(r["batch"], r["arm"]) for r in rows} == {(1, "jax-no-cmdbuf"), (3, "jax-no-cmdbuf")}
    assert all(r["floor_ms"] > 0 and r["vs_cudagraph"] is None for r in rows)


@pytest.mark.oracle
@pytest.mark.skipif(not os.path.exists(TORCH_PYTHON), reason="no Python with torch (set MRV2_TORCH_PYTHON)")
def test_torch_eager_arm_on_cpu(tmp_path):
    """The PyTorch side with the Hugging Face model: eager runs on the CPU, the graph needs CUDA."""
    out = tmp_path / "x.json"
    bench.main([*COMMON, "--arms", "torch-cudagraph,torch-eager", "--torch-python", TORCH_PYTHON, "--allow-cpu",
                "--output-json", str(out)])
    arms = json.loads(out.read_text())["arms"]
    assert arms["torch-cudagraph"]["skipped"] == "needs CUDA"
    for batch in ("1", "3"):
        r = arms["torch-eager"]["batches"][batch]
        assert r["sync_ms"] > 0 and r["pipelined_ms"] > 0 and r["kv_bytes"] == int(batch) * 12 * 2 * 2 * 2 * 16 * 4
