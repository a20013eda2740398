"""The `mrv2-jax bench` commands run end to end on the tiny fixture model and write well-formed
reports (schema and sane values, not speeds)."""

import json
import subprocess
import sys
from pathlib import Path

from mrv2_jax.bench.throughput import random_prompts
from mrv2_jax.entrypoints import cli

MODEL = str(Path(__file__).parent / "fixtures" / "qwen3-tiny")
ENGINE = ["--model", MODEL, "--dtype", "float32", "--num-gpu-blocks", "256", "--block-size", "4",
          "--max-model-len", "128", "--max-num-batched-tokens", "32", "--max-num-seqs", "8"]
ENVIRONMENT_KEYS = {"date", "git_sha", "jax_version", "backend", "device"}


def test_random_prefix_is_shared_by_every_prompt():
    prompts = random_prompts(6, 10, 0.5, 5000, seed=3, prefix_len=7)
    prefix = prompts[0][:7]
    assert all(p[:7] == prefix for p in prompts)
    assert all(5 <= len(p) - 7 <= 15 for p in prompts)
    assert len({tuple(p[7:]) for p in prompts}) == 6  # the rest is each prompt's own
    # Without a prefix the dataset is the same as before the option existed.
    assert [p[7:] for p in prompts] == random_prompts(6, 10, 0.5, 5000, seed=3)
    assert random_prompts(6, 10, 0.5, 5000, seed=4, prefix_len=7)[0][:7] != prefix


def test_bench_help_lists_both_benchmarks():
    run = subprocess.run([sys.executable, "-m", "mrv2_jax.entrypoints.cli", "bench", "--help"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert "throughput" in run.stdout and "ab" in run.stdout


def test_bench_throughput(tmp_path):
    out = tmp_path / "throughput.json"
    assert cli.main(["bench", "throughput", "--num-prompts", "8", "--input-len", "8", "--output-len", "6",
                     "--random-prefix-len", "8", "--runner", "v2", "--output-json", str(out), *ENGINE]) == 0
    result = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= result.keys()
    assert result["num_prompts"] == 8 and result["random_prefix_len"] == 8
    assert result["num_input_tokens"] == 8 * (8 + 8)
    assert result["num_output_tokens"] == 8 * 6
    assert result["output_tokens_per_s"] > 0 and result["total_tokens_per_s"] > 0 and result["elapsed_s"] > 0
    assert result["runner"] == "v2"
    assert result["settings"]["max_num_seqs"] == 8 and result["settings"]["block_size"] == 4


def test_bench_ab_report_and_plot(tmp_path):
    out, png = tmp_path / "ab.json", tmp_path / "ab.png"
    assert cli.main(["bench", "ab", "--num-prompts", "8", "--input-len", "8", "--output-len", "8",
                     "--capture-step", "2", "--output-json", str(out), "--plot", str(png), *ENGINE]) == 0
    report = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= report.keys()
    assert report["settings"]["num_prompts"] == 8 and report["load_s"] > 0
    arms = {r["arm"]: r for r in report["arms"]}
    assert list(arms) == ["v1", "v2-sync", "v2-async"]
    for r in arms.values():
        assert r["output_tokens_per_s"] > 0 and r["num_steps"] > 0 and r["steady_decode_rows"] == 8
    assert arms["v1"]["steady_step_device_ms"] is None  # replay is a V2 feature
    for name in ("v2-sync", "v2-async"):  # the steady-decode step was captured and replayed
        assert arms[name]["steady_step_wall_ms"] > 0 and arms[name]["steady_step_device_ms"] > 0
        assert arms[name]["gpu_busy_fraction"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_moe_smoke_at_tiny_shapes(tmp_path):
    """The MoE benchmark runs end to end (CPU: the kernel in the Pallas interpreter)."""
    from mrv2_jax.bench import moe

    out = tmp_path / "moe.json"
    report = moe.main(["--tokens", "8", "--experts", "4", "--top-k", "2", "--hidden", "128",
                       "--moe-intermediate", "128", "--runs", "1", "--warmup", "1", "--output-json", str(out)])
    assert ENVIRONMENT_KEYS <= json.loads(out.read_text()).keys()
    cases = {r["case"]: r for r in report["results"]}
    assert set(cases) == {"layer/pallas", "layer/ragged_dot", "layer/dense", "layer/pallas_fp8",
                          "gemm/pallas", "gemm/ragged_dot"}
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in cases.values())
    assert "layer/ragged_dot / layer/pallas @ 8" in report["speedups"]
