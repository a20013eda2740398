"""The microbenchmarks and probes of benchmarks/ run end to end at tiny shapes on the CPU (kernels
in the Pallas interpreter) and write well-formed reports (schema and sane values, not speeds)."""

import json

ENVIRONMENT_KEYS = {"date", "git_sha", "jax_version", "backend", "device"}


def test_bench_moe_smoke_at_tiny_shapes(tmp_path):
    """The MoE benchmark runs end to end (CPU: the kernels in the Pallas and Mosaic GPU interpreters)."""
    from benchmarks import moe

    out = tmp_path / "moe.json"
    report = moe.main(["--tokens", "8", "--experts", "4", "--top-k", "2", "--hidden", "128",
                       "--moe-intermediate", "128", "--runs", "1", "--warmup", "1", "--output-json", str(out)])
    assert ENVIRONMENT_KEYS <= json.loads(out.read_text()).keys()
    cases = {r["case"]: r for r in report["results"]}
    assert set(cases) == {"layer/pallas", "layer/mgpu", "layer/ragged_dot", "layer/dense", "layer/pallas_fp8",
                          "layer/mgpu_fp8", "gemm/pallas", "gemm/mgpu", "gemm/ragged_dot"}
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in cases.values())
    assert {"layer/ragged_dot / layer/pallas @ 8", "gemm/pallas / gemm/mgpu @ 8"} <= report["speedups"].keys()


def test_host_step_bench_runs_a_few_steps():
    from benchmarks.host_step import PARTS, run_case

    for final_only in (True, False):
        r = run_case(None, rows=8, steps=6, final_only=final_only, prompt_len=8)
        assert r["num_steps"] >= 4
        assert all(r[k] >= 0 for k in PARTS) and r["engine_total"] > 0


def test_host_step_bench_writes_its_cases(tmp_path):
    from benchmarks import host_step

    out = tmp_path / "host_step.json"
    host_step.main(["--rows", "4", "--steps", "6", "--prompt-len", "8", "--tokenizer", "none", "--evict-mb", "1",
                    "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= report.keys()
    assert report["settings"]["evict_mb"] == 1
    assert [(c["rows"], c["final_only"]) for c in report["cases"]] == [(4, True), (4, False)]
    assert all(c["median_us"]["engine_total"] > 0 for c in report["cases"])


def test_conditionals_bench_chains_agree_and_report(tmp_path):
    """The lax.cond chain and its jnp.where twin compute the same values; the report has both."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import conditionals

    big, small = jnp.ones((4, 16), jnp.float32), jnp.arange(4, dtype=jnp.float32)
    for n in (0, 3):
        np.testing.assert_allclose(conditionals.chain(n, True)(big, small), conditionals.chain(n, False)(big, small))
    out = tmp_path / "cond.json"
    report = conditionals.main(["--counts", "0", "2", "--runs", "2", "--warmup", "1", "--output-json", str(out)])
    assert ENVIRONMENT_KEYS <= json.loads(out.read_text()).keys()
    assert {(r["conditionals"], r["n"]) for r in report["results"]} == {(c, n) for c in (False, True) for n in (0, 2)}
    assert report["us_per_cond"] is not None


def test_sampler_bench_top_n_cases_and_hlo_dump(tmp_path):
    from benchmarks import sampler

    out, hlo = tmp_path / "sampler.json", tmp_path / "hlo"
    sampler.main(["--num-rows", "4", "--vocab", "3000", "--runs", "2", "--warmup", "1", "--cases",
                  "top64_blocks_128_16", "top20_blocks_256_32_4", "greedy", "--hlo-dir", str(hlo),
                  "--timeline", "greedy", "--output-json", str(out)])
    cases = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert set(cases) == {"top64_blocks_128_16", "top20_blocks_256_32_4", "greedy"}
    assert all(r["median_ms"] > 0 for r in cases.values())
    assert "ENTRY" in (hlo / "greedy.hlo.txt").read_text()  # the optimized module, written per case


def test_logit_stats_bench_runs_the_kernels_interpreted(tmp_path):
    from benchmarks import logit_stats

    out = tmp_path / "logit_stats.json"
    logit_stats.main(["--num-rows", "2", "--vocab", "700", "--calls", "1", "--tile-blocks", "2", "--num-warps", "4",
                      "--loops", "2x1", "--interpret", "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= report.keys()
    cases = {(c["inputs"], c["case"]) for c in report["cases"]}
    assert ("bfloat16 logits, uint16 counts", "kernel tb=2 warps=4") in cases and len(cases) == 2 * 7
    assert all(c["ms"] > 0 for c in report["cases"])


def test_unrolled_copies_compiles_one_step_per_unroll_value(tmp_path):
    """One decode step program per --layer-unroll value, its memory analysis and large copies
    (the demo model's KV cache is an argument of the step, so the arguments hold at least it)."""
    from benchmarks import unrolled_copies

    out = tmp_path / "copies.json"
    # The greedy variant first: the benchmark analyses the cheapest variant, a third of `all`'s compile.
    results = unrolled_copies.main(["--rows", "8", "--min-mib", "0", "--max-model-len", "128",
                                    "--sampler-variants", "greedy,all", "--output-json", str(out)])
    programs = [(r["layer_unroll"], r["program"]) for r in results]
    assert programs == [(1, "step"), (1, "fused"), (0, "step"), (0, "fused")]
    for r in results:
        assert r["argument_size_in_bytes"] >= r["kv_cache_gib"] * 2**30 > 0
        assert all(c["line"].split("=")[1].strip().startswith(c["dtype"]) for c in r["large_copies"])
    assert ENVIRONMENT_KEYS <= json.loads(out.read_text()).keys()


def test_loop_callback_probe_delivers_every_step_to_the_host():
    """The callback way hands the host one arrival per step of the loop, as the one-step-per-call
    way does, and every way reports a time per step."""
    from benchmarks import loop_callback

    results = loop_callback.main(["--steps", "4", "--layers", "2", "--hidden", "64", "--rows", "2", "--calls", "2"])
    assert set(results) == {"loop", "loop + callback", "one step per call"}
    assert results["loop + callback"]["arrivals_per_call"] == results["one step per call"]["arrivals_per_call"] == 4
    assert all(r["ms_per_step"] > 0 for r in results.values()) and "gap_ms_median" not in results["loop"]
