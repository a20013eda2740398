"""Start-up as a user sees it: seconds from launching the server process to /health answering 200,
and to the first token of a first request, for `mrv2-jax serve` (cold: an empty compilation cache;
warm: the cache the cold start filled) and, with the vLLM payload, `vllm serve`. The cold server is
kept up after its first token until its background compiles are done (/metrics'
mrv2_step_programs_pending), so that the warm start finds every program in the store, as after any
run that lasted; `--stop-cold-early` stops it at once instead (the warm start then compiles the rest).

    python -m benchmarks.first_token --model qwen3-0.6b --load-format dummy --tokenizer /tmp/qwen3-0.6b \
        --compile-mode background --vllm-model /tmp/qwen3-0.6b --vllm-site /tmp/site

Each start is a fresh process (bench/serve.py's LaunchedServer, serve_compare's LaunchedVllm, which
poll /health every 0.5 s). The mrv2-jax server logs its engine's start-up report (phases, seconds
spent compiling, executables compiled and loaded from the cache) at INFO: that line is copied into
the result.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import httpx

from mrv2_jax import envs
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.bench.serve import LaunchedServer, free_port
from mrv2_jax.bench.serve_compare import LaunchedVllm
from mrv2_jax.entrypoints.cli import add_engine_args

MODEL_NAME = "model"


def programs_pending(url: str) -> int | None:
    """The server's mrv2_step_programs_pending gauge (None if /metrics does not have it)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        if family.name == "mrv2_step_programs_pending":
            return int(sum(sample.value for sample in family.samples))
    return None


STALL_S = 60.0  # no program made for this long: the server compiles at first use (lazy), not beside


def time_to_first_token(launcher: LaunchedServer, wait_for_compiles: bool = False) -> dict:
    """{health_s, first_token_s} of one launch (stopped afterwards), or {error}. wait_for_compiles:
    keep the server up after its first token until no step program is left to compile (a request a
    second refreshes the engine's counters), and add `compiles_done_s` (from launch; None if the
    count stalled for STALL_S) and `programs_left`."""
    try:
        with launcher as server:
            body = {"model": MODEL_NAME, "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0.0}
            start = time.perf_counter()
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=launcher.timeout)
            if r.status_code != 200:
                return {"error": f"first request: {r.status_code} {r.text[:200]}"}
            result = {"health_s": server.startup_s, "first_token_s": server.startup_s + time.perf_counter() - start}
            if not wait_for_compiles:
                return result
            left, changed = programs_pending(server.url), time.perf_counter()
            while left and time.perf_counter() - changed < STALL_S:
                if time.perf_counter() - start > launcher.timeout:
                    return result | {"error": "step programs still compiling at the timeout"}
                time.sleep(1.0)
                httpx.post(server.url + "/v1/completions", json=body, timeout=launcher.timeout)
                now = programs_pending(server.url)
                if now != left:
                    left, changed = now, time.perf_counter()
            done = None if left else server.startup_s + time.perf_counter() - start
            return result | {"compiles_done_s": done, "programs_left": left}
    except RuntimeError as e:  # it exited or was not ready in time: the launcher says why
        return {"error": str(e)}


def startup_report_line(log_path: str, marker: str = "engine start-up") -> str | None:
    """The last log line holding `marker`: the engine's start-up report, or the API process's
    ("API process start-up": seconds since that process started at each milestone)."""
    with open(log_path) as f:
        lines = [line.strip() for line in f if marker in line]
    return lines[-1] if lines else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-model", default=None, help="also time `vllm serve` of this model directory")
    p.add_argument("--vllm-site", default=None)
    p.add_argument("--vllm-python", default=sys.executable)
    p.add_argument("--vllm-arg", action="append", default=[])
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--stop-cold-early", action="store_true",
                   help="stop the cold server right after its first token (default: once its background "
                        "compiles are done, so that the warm start finds every program in the store)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    args = p.parse_args(argv)
    args.served_model_name = MODEL_NAME
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="first-token-")
    cache = tempfile.mkdtemp(prefix="first-token-cache-")  # empty: the first start is cold
    results = {}
    for start in ("cold", "warm"):
        log = os.path.join(log_dir, f"first_token_mrv2_{start}.log")
        launcher = LaunchedServer(args, "127.0.0.1", free_port("127.0.0.1"), log, args.timeout, log_level="info")
        launcher.command += ["--served-model-name", MODEL_NAME]
        launcher.env = envs.subprocess_env(MRV2_COMPILATION_CACHE=cache)
        wait = start == "cold" and not args.stop_cold_early
        results[f"mrv2 {start}"] = time_to_first_token(launcher, wait_for_compiles=wait) | {
            "startup_report": startup_report_line(log), "api_startup": startup_report_line(log, "API process start-up")}
    if args.vllm_model:
        for start in ("first", "second"):  # vLLM keeps its own compile cache under ~/.cache/vllm
            log = os.path.join(log_dir, f"first_token_vllm_{start}.log")
            launcher = LaunchedVllm(args, "127.0.0.1", free_port("127.0.0.1"), log, args.timeout)  # its env: vLLM's
            results[f"vllm {start}"] = time_to_first_token(launcher)
    print(f"{'server, start':18} {'/health s':>10} {'first token s':>14} {'compiles done s':>16}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:18} {r['error']}")
        else:
            done = f"{r['compiles_done_s']:16.1f}" if r.get("compiles_done_s") is not None else ""
            print(f"{name:18} {r['health_s']:10.1f} {r['first_token_s']:14.1f} {done}")
    print(json.dumps({k: [r.get("startup_report"), r.get("api_startup")] for k, r in results.items()
                      if r.get("startup_report")}, indent=1))
    report = {**describe_environment(probe_device=False), "settings": vars(args), "results": results}
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
