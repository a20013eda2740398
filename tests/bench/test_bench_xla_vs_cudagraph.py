"""The XLA vs CUDA-graph benchmark on the CPU: the JAX arms (each its own process, one with the
command-buffer flag off) on the tiny model; the PyTorch arms are reported as skipped where torch
or CUDA is missing, and the eager one runs on the CPU when a Python with torch is given; the vLLM
arm is reported as skipped where vLLM does not import, or (its script run in vLLM's environment)
where there is no GPU."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from mrv2_jax.bench import xla_vs_cudagraph as bench

MODEL = str(Path(__file__).parents[1] / "fixtures" / "qwen3-tiny")
# An 8-token budget: one step program serves the chunked prefills and the decode steps alike.
COMMON = ["--model", MODEL, "--load-format", "auto", "--dtype", "float32", "--batches", "1,3", "--context", "12",
          "--runs", "3", "--warmup", "1", "--max-num-batched-tokens", "8"]
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


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm imports here")
def test_vllm_arm_skipped_where_vllm_does_not_import(tmp_path):
    out = tmp_path / "x.json"
    bench.main([*COMMON, "--arms", "vllm-cudagraph", "--vllm-python", sys.executable, "--vllm-site", str(tmp_path),
                "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert report["arms"]["vllm-cudagraph"]["skipped"].startswith("vllm does not import (ModuleNotFoundError")
    assert report["table"] == [] and any("vllm-cudagraph" in n for n in report["notes"])


# Stand-ins on the vLLM arm's PYTHONPATH: a vllm that notes each process importing it, and a torch
# without CUDA. The arm runs its real script through the real launcher, which must report the skip.
STUB_VLLM = """import json, os, sys
__version__ = "0.0-stub"
keys = ("PYTHONPATH", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER", "HF_HUB_OFFLINE",
        "VLLM_USE_FLASHINFER_SAMPLER")
with open(os.path.join(os.path.dirname(__file__), "..", "imports.jsonl"), "a") as f:
    f.write(json.dumps({"argv": sys.argv, "env": {k: os.environ.get(k) for k in keys}}) + "\\n")
"""
STUB_TORCH = """__version__ = "0.0-stub"
class cuda:
    is_available = staticmethod(lambda: False)
"""


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_vllm_arm_runs_its_script_in_vllms_environment(tmp_path, runner):
    site = tmp_path / "site"
    for name, text in (("vllm", STUB_VLLM), ("torch", STUB_TORCH)):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(text)
    out = tmp_path / "x.json"
    bench.main([*COMMON, "--arms", "vllm-cudagraph", "--vllm-python", sys.executable, "--vllm-site", str(site),
                "--vllm-model", MODEL, "--vllm-runner", runner, "--output-json", str(out)])
    arm = json.loads(out.read_text())["arms"]["vllm-cudagraph"]
    assert arm["skipped"] == "no CUDA device" and arm["vllm_version"] == "0.0-stub" and arm["process_s"] > 0
    probe, script = [json.loads(line) for line in (site / "imports.jsonl").read_text().splitlines()]
    assert probe["argv"] == ["-c"]  # the launcher's check that vllm imports, then the arm's script
    assert script["argv"][0].endswith("mrv2_jax/bench/vllm_decode_graph.py")
    assert script["argv"][script["argv"].index("--batches") + 1] == "1,3"
    assert script["argv"][script["argv"].index("--model") + 1] == MODEL
    env = script["env"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == {"v2": "1", "v1": "0"}[runner]
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
