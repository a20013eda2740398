"""`mrv2-jax bench serve` against a real HTTP server on 127.0.0.1 (the demo model, which has a
tokenizer and so streams a chunk per token): schema and sane values, not speeds."""

import json
import time

import numpy as np
import pytest

from mrv2_jax.bench import serve
from mrv2_jax.entrypoints import cli
from tests.server_harness import MODEL_NAME, make_llm, running_server

ENVIRONMENT_KEYS = {"date", "git_sha", "jax_version", "backend", "device"}


@pytest.fixture(scope="module")
def server():
    with running_server(make_llm()) as s:
        yield s


def test_bench_serve_report(server, tmp_path):
    out = tmp_path / "serve.json"
    report = cli.main(["bench", "serve", "--base-url", server.url, "--model", "demo", "--num-prompts", "10",
                       "--input-len", "12", "--output-len", "6", "--ignore-eos", "--max-concurrency", "4",
                       "--num-warmups", "2", "--metric-percentiles", "50,99", "--save-detailed",
                       "--disable-tqdm", "--output-json", str(out)])
    assert report == 0
    result = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= result.keys()
    m = result["metrics"]
    assert m["completed"] == 10 and m["failed"] == 0 and result["errors"] == []
    assert m["total_input_tokens"] == 10 * 12 and m["total_output_tokens"] == 10 * 6
    assert 1 <= m["max_concurrent_requests"] <= 4
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "duration_s"):
        assert m[key] > 0
    for name in serve.METRICS:
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{name}_ms" in m
        assert m[f"p99_{name}_ms"] >= m[f"p50_{name}_ms"] >= 0
    assert 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"]
    for r in result["requests"]:
        assert r["success"] and r["output_tokens"] == 6 and r["prompt_len"] == 12
        assert 0 < r["ttft"] <= r["e2el"]
        # A chunk per token (minus what the detokenizer merges), and the gaps add up.
        assert 1 <= len(r["itl"]) <= 6 and sum(r["itl"]) <= r["e2el"] - r["ttft"] + 1e-6
    assert result["settings"]["max_concurrency"] == 4 and result["settings"]["request_rate"] == "inf"


def test_bench_serve_reports_its_client_cpu_busy(server):
    """The client's CPU time over the measured run (here the in-process server's too) per second of its wall
    time; past CLIENT_BUSY the report says the client may have been the bottleneck."""
    args = serve.build_parser().parse_args(
        ["--base-url", server.url, "--model", "demo", "--num-prompts", "8", "--input-len", "12",
         "--output-len", "6", "--ignore-eos", "--max-concurrency", "4", "--num-warmups", "0", "--disable-tqdm"])
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    m = serve.run(args)["metrics"]
    cpu, wall = time.process_time() - cpu_start, time.perf_counter() - wall_start
    # The run is a part of the call: its CPU seconds are at most the call's, its wall time at most the call's.
    assert 0 < m["client_cpu_busy"] * m["duration_s"] <= cpu and m["duration_s"] <= wall
    assert m["client_may_be_bound"] == (m["client_cpu_busy"] > serve.CLIENT_BUSY)


def test_bench_serve_poisson_rate_counts_failures(server):
    """A finite rate spaces the arrivals; a request the server rejects (prompt over the context)
    is reported as failed, not fatal."""
    args = serve.build_parser().parse_args(
        ["--base-url", server.url, "--model", "demo", "--num-prompts", "4", "--input-len", "300",
         "--output-len", "2", "--request-rate", "50", "--disable-tqdm"])
    report = serve.run(args)
    assert report["metrics"]["completed"] == 0 and report["metrics"]["failed"] == 4
    assert "HTTP 400" in report["errors"][0]


@pytest.mark.parametrize("store", [[], ["--program-store"], ["--no-program-store"]])
def test_engine_argv_round_trips_through_the_serve_parser(store):
    args = serve.build_parser().parse_args(["--model", "demo", "--max-num-seqs", "4", "--no-prefix-caching",
                                            "--no-async-scheduling", "--runner", "v2", *store])
    argv = serve.engine_argv(args)
    assert "--no-prefix-caching" in argv and "--no-async-scheduling" in argv
    again = cli.build_parser().parse_args(["serve", *argv])
    assert cli.engine_kwargs(again) | {"show_progress": None} == cli.engine_kwargs(args) | {"show_progress": None}
    assert cli.engine_kwargs(again)["program_store"] == {(): None, ("--program-store",): True}.get(tuple(store), False)


def test_bench_serve_launches_and_stops_its_own_server(tmp_path):
    """--launch-server: `mrv2-jax serve` as a subprocess with these engine arguments, ready at
    /health, stopped (with its engine) when the run ends."""
    log = tmp_path / "server.log"
    # The engine shape of tests/server_harness.py: the server's steps load from the compilation cache.
    report = serve.main(["--launch-server", "--model", "demo", "--dtype", "float32", "--max-num-seqs", "16",
                         "--max-num-batched-tokens", "32", "--max-model-len", "256", "--num-gpu-blocks", "160",
                         "--num-prompts", "6", "--input-len", "10", "--output-len", "4", "--ignore-eos",
                         "--disable-tqdm", "--server-log", str(log), "--compile-mode", "lazy"])
    assert report["metrics"]["completed"] == 6 and report["metrics"]["total_output_tokens"] == 24
    assert report["server_startup_s"] > 0 and report["metrics"]["max_concurrent_requests"] <= 6


def test_serve_compare_pools_its_client_processes(server, tmp_path):
    """`bench serve-compare` against the running server with mrv2-jax's client: two client
    processes at concurrency 3, their requests pooled into one row, after a discarded warm-up round
    of one prompt per stream at the largest level; JSON and plot written."""
    from mrv2_jax.bench import serve_compare

    out, png = tmp_path / "sc.json", tmp_path / "sc.png"
    report = serve_compare.main(
        ["--servers", "mrv2", "--client", "mrv2", "--mrv2-base-url", server.url, "--model", "demo",
         "--served-model-name", MODEL_NAME, "--concurrency", "1", "3", "--streams-per-client", "2",
         "--prompts-per-stream", "2", "--min-prompts", "4", "--input-len", "8", "--output-len", "5",
         "--ignore-eos", "--output-json", str(out), "--plot", str(png)])
    assert ENVIRONMENT_KEYS <= json.loads(out.read_text()).keys() and png.stat().st_size > 0
    low, high = report["results"]["mrv2"]["levels"]
    assert (low["client_processes"], high["client_processes"]) == (1, 2)
    assert (low["completed"], high["completed"]) == (4, 6)
    warm = report["results"]["mrv2"]["warmup"]
    assert (warm["concurrency"], warm["prompts"], warm["failed"]) == (3, 3, 0) and warm["duration_s"] > 0
    assert high["output_tokens"] == 6 * 5 and high["output_throughput"] > 0
    assert 0 < high["mean_ttft_ms"] and 0 <= high["mean_itl_ms"] <= high["p99_itl_ms"]
    assert 0 < high["client_cpu_busy_max"]
    # The server's own view of the level (its /metrics): inter-token gaps and step intervals.
    assert 0 < high["server_itl_p50_ms"] <= high["server_itl_p99_ms"]
    assert 0 < high["step_interval_p50_ms"] <= high["step_interval_p99_ms"]
    # Split by the step that ended the interval: 6 prompts of 8 tokens, each request 4 decode steps.
    assert 0 < high["prefill_step_share"] < 1
    assert 0 < high["decode_step_interval_p50_ms"] <= high["decode_step_interval_p99_ms"]
    assert 0 < high["prefill_step_interval_p50_ms"] <= high["prefill_step_interval_p99_ms"]
    # The engine runs on a thread of this server: no message leaves an engine process to be timed.
    assert high["engine_decode_interval_p99_ms"] is None and high["decode_delivery_p99_ms"] is None


def test_client_pool_reuses_its_workers_and_keeps_them_after_a_failed_run(server, tmp_path):
    """The pool's client processes stay up between runs: a run whose arguments the client refuses
    comes back as that run's error, and the same processes then run the next ones."""
    from mrv2_jax.bench.client_pool import ClientPool

    def argv(name):
        return ["--base-url", server.url, "--model", "demo", "--served-model-name", MODEL_NAME, "--num-prompts", "2",
                "--input-len", "8", "--output-len", "3", "--ignore-eos", "--disable-tqdm",
                "--output-json", str(tmp_path / name)]

    with ClientPool("mrv2", 2, str(tmp_path)) as pool:
        pids = [worker.pid for worker in pool.workers]
        bad, good = pool.run([["--no-such-flag"], argv("a.json")])
        assert "exited with 2" in bad.error and good.error is None
        again = pool.run([argv("b.json"), argv("c.json")])
        assert [worker.pid for worker in pool.workers] == pids and all(w.poll() is None for w in pool.workers)
        assert all(run.error is None and run.wall_s > 0 <= run.cpu_s for run in again)
    assert all(worker.poll() is not None for worker in pool.workers)  # closed with the pool
    for name in ("a.json", "b.json", "c.json"):
        metrics = json.loads((tmp_path / name).read_text())["metrics"]
        assert (metrics["completed"], metrics["total_output_tokens"]) == (2, 6)


def test_a_client_worker_that_cannot_start_says_why(tmp_path):
    from mrv2_jax.bench.client_pool import ClientPool

    with ClientPool("no-such-client", 1, str(tmp_path)) as pool, pytest.raises(RuntimeError, match="KeyError"):
        pool.run([["--help"]])


def test_serve_compare_counts_failed_requests_with_their_error(server, tmp_path):
    """Requests the server refuses (a model name it does not serve) are left out of the metrics,
    counted, and the first one's error kept, instead of a silent row of zeros."""
    from mrv2_jax.bench import serve_compare

    report = serve_compare.main(
        ["--servers", "mrv2", "--client", "mrv2", "--mrv2-base-url", server.url, "--model", "demo",
         "--served-model-name", "not-" + MODEL_NAME, "--concurrency", "2", "--warmup-prompts-per-stream", "0",
         "--prompts-per-stream", "1", "--min-prompts", "3", "--input-len", "8", "--output-len", "4",
         "--output-json", str(tmp_path / "sc.json")])
    (level,) = report["results"]["mrv2"]["levels"]
    assert (level["completed"], level["failed"]) == (0, 3)
    assert "HTTP 404" in level["first_error"] and "not-" + MODEL_NAME in level["first_error"]


def test_serve_compare_metrics_pool_requests_as_a_plain_loop_does():
    from mrv2_jax.bench.serve_compare import pooled_metrics

    rows = [{"ttft": 0.010, "itl": [0.002, 0.004], "output_tokens": 3},
            {"ttft": 0.030, "itl": [0.001, 0.001, 0.001, 0.009], "output_tokens": 5}]
    m = pooled_metrics(rows, duration=2.0)
    gaps = [0.002, 0.004, 0.001, 0.001, 0.001, 0.009]
    assert m["output_throughput"] == 8 / 2.0 and m["completed"] == 2
    assert abs(m["mean_ttft_ms"] - 20.0) < 1e-9 and abs(m["median_ttft_ms"] - 20.0) < 1e-9
    assert abs(m["max_ttft_ms"] - 30.0) < 1e-9 and 29.0 < m["p99_ttft_ms"] <= 30.0 + 1e-9
    assert abs(m["mean_itl_ms"] - 1e3 * sum(gaps) / len(gaps)) < 1e-9
    assert abs(m["mean_tpot_ms"] - 1e3 * (0.006 / 2 + 0.012 / 4) / 2) < 1e-9
    assert m["p99_itl_ms"] <= 9.0 + 1e-9 and m["p99_itl_ms"] > 4.0
    assert m["tokens_per_chunk"] == 1.0  # 3 and 5 tokens in 3 and 5 chunks
    merged = pooled_metrics([{"ttft": 0.01, "itl": [0.004], "output_tokens": 3}], duration=1.0)
    assert merged["tokens_per_chunk"] == 3 / 2  # two of the tokens came in one chunk


def test_serve_compare_without_vllm_says_so():
    from mrv2_jax.bench import serve_compare

    with pytest.raises(RuntimeError, match="vLLM is needed"):
        serve_compare.main(["--servers", "mrv2,vllm", "--vllm-python", "/nonexistent/python"])


def test_histogram_quantile_between_two_scrapes_matches_numpy():
    """`quantile` over the difference of two cumulative histograms: the value lies in the bucket
    that holds numpy's percentile of the samples observed between the scrapes (not before)."""
    from mrv2_jax.bench.server_histograms import quantile

    bounds = [0.001, 0.002, 0.004, 0.008, 0.016, float("inf")]
    rng = np.random.default_rng(0)
    early, late = rng.lognormal(-6.5, 0.6, 400), rng.lognormal(-5.5, 0.8, 1000)

    def cumulative(samples):
        return {le: float(np.sum(samples <= le)) for le in bounds}

    before, after = cumulative(early), cumulative(np.concatenate([early, late]))
    for q in (0.5, 0.9, 0.99):
        exact = np.percentile(late, 100 * q)
        upper = next(le for le in bounds if exact <= le)
        lower = max([0.0] + [le for le in bounds if le < upper])
        assert lower <= quantile(before, after, q) <= upper, q
    assert quantile(after, after, 0.5) is None
    assert quantile(None, cumulative(np.array([0.5])), 0.99) == 0.016  # past the last bound: its lower edge
