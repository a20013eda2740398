"""`bench compare` on the CPU: vLLM is not installed here, so its arms are reported as skipped
with the reason; an mrv2-jax arm runs (in its own process) on the tiny model; every arm's command
line carries the same settings; --merge joins reports and draws the plot."""

import json
from pathlib import Path

from mrv2_jax.bench import compare

MODEL = str(Path(__file__).parents[1] / "fixtures" / "qwen3-tiny")


def test_compare_runs_mrv2_arms_and_skips_vllm(tmp_path):
    out = tmp_path / "c.json"
    # An 8-token budget: the prompts prefill in chunks through one step bucket, one program less to compile;
    # the plain sampler variant first (as on GPUs): it covers temperature-1 batches and compiles faster than `all`.
    report = compare.main(["--settings", "custom", "--custom", "8,6,6,4", "--arms", "vllm-mrv2,mrv2-v2-async",
                           "--model", MODEL, "--max-num-batched-tokens", "8", "--warmup-prompts", "2",
                           "--vllm-python", "/nonexistent/python", "--mrv2-arg=--num-gpu-blocks", "--mrv2-arg=256",
                           "--mrv2-arg=--sampler-variants", "--mrv2-arg=plain,all", "--output-json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["table"] == json.loads(json.dumps(report["table"]))
    assert {"date", "git_sha", "jax_version", "device"} <= saved.keys() and saved["notes"]
    arms = saved["results"]["custom"]
    assert "skipped" in arms["vllm-mrv2"] and saved["vllm_version"] is None
    r = arms["mrv2-v2-async"]
    assert r["output_tokens_per_s"] > 0 and r["total_tokens_per_s"] > r["output_tokens_per_s"]
    (run,) = r["repeats"]
    assert run["num_output_tokens"] == 6 * 6 and run["num_input_tokens"] == 6 * 8
    assert run["runner"] == "v2" and run["async_scheduling"] is True
    rows = {r["arm"]: r for r in saved["table"]}
    assert rows["vllm-mrv2"]["status"].startswith("skipped") and rows["mrv2-v2-async"]["vs_vllm_mrv2"] is None


def test_every_arm_gets_the_same_settings():
    args = compare.parse_args(["--settings", "s1-256", "--vllm-site", "/tmp/site", "--vllm-model", "/tmp/q"])
    commands = {arm: compare.arm_command(arm, "s1-256", args, "/tmp/o.json") for arm in compare.ARMS}
    shared = ["--input-len", "128", "--output-len", "512", "--num-prompts", "1000", "--max-num-seqs", "256",
              "--max-num-batched-tokens", "8192", "--max-model-len", "768", "--temperature", "1.0"]
    for arm, (cmd, env) in commands.items():
        assert " ".join(shared) in " ".join(cmd), arm
    assert commands["vllm-mrv2"][1]["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert commands["vllm-v1"][1]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert commands["vllm-v1"][1]["PYTHONPATH"].startswith("/tmp/site")
    assert "/tmp/q" in commands["vllm-v1"][0] and "mrv2_jax.bench.vllm_throughput" in commands["vllm-v1"][0]
    assert commands["mrv2-v1"][0][-1] != "--no-async-scheduling" and "v1" in commands["mrv2-v1"][0]
    assert "--no-async-scheduling" in commands["mrv2-v2-sync"][0]
    assert "--no-async-scheduling" not in commands["mrv2-v2-async"][0]


def test_compare_merge_and_plot(tmp_path):
    def report(setting, arms):
        return {"git_sha": "abc", "device": "H200", "vllm_version": "0.22.1", "settings": {"temperature": 1.0},
                "results": {setting: {a: {"output_tokens_per_s": v, "total_tokens_per_s": 2 * v, "startup_s": 1.0}
                                      for a, v in arms.items()}}}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report("s1-256", {"vllm-mrv2": 100.0, "mrv2-v2-async": 150.0})))
    b.write_text(json.dumps(report("s2", {"vllm-mrv2": 50.0, "mrv2-v1": 25.0})))
    png, out = tmp_path / "c.png", tmp_path / "c.json"
    merged = compare.main(["--merge", str(a), str(b), "--plot", str(png), "--output-json", str(out)])
    assert set(merged["results"]) == {"s1-256", "s2"} and merged["merged_from"] == [str(a), str(b)]
    ratios = {(r["setting"], r["arm"]): r["vs_vllm_mrv2"] for r in merged["table"]}
    assert ratios == {("s1-256", "vllm-mrv2"): 1.0, ("s1-256", "mrv2-v2-async"): 1.5, ("s2", "vllm-mrv2"): 1.0,
                      ("s2", "mrv2-v1"): 0.5}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
