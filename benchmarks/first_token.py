"""Start-up as a user sees it: seconds from launching the server process to /health answering 200,
and to the first token of a first request, for `mrv2-jax serve` (cold: an empty compilation cache;
warm: the cache the cold start filled) and, with the vLLM payload, `vllm serve`.

    python -m benchmarks.first_token --model qwen3-0.6b --load-format dummy --tokenizer /tmp/qwen3-0.6b \
        --serve-arg=--compile-mode=background --vllm-model /tmp/qwen3-0.6b --vllm-site /tmp/site

Each start is a fresh process. The mrv2-jax server logs its engine's start-up report (phases, seconds
spent compiling, executables compiled and loaded from the cache) at INFO: that line is copied into
the result.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from mrv2_jax import envs
from mrv2_jax.bench.compare import vllm_env
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.bench.serve import free_port


def time_to_first_token(command: list[str], env: dict, model_name: str, log_path: str, timeout: float) -> dict:
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        ready = None
        while ready is None:
            if proc.poll() is not None or time.perf_counter() - start > timeout:
                return {"error": f"no /health 200 (exit code {proc.poll()}); see {log_path}"}
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    ready = time.perf_counter() - start
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": model_name, "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0.0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        first = time.perf_counter() - start
        if r.status_code != 200:
            return {"error": f"first request: {r.status_code} {r.text[:200]}"}
        return {"health_s": ready, "first_token_s": first}
    finally:
        proc.send_signal(2)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def startup_report_line(log_path: str) -> str | None:
    with open(log_path) as f:
        lines = [line.strip() for line in f if "engine start-up" in line]
    return lines[-1] if lines else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--load-format", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--serve-arg", action="append", default=[], help="one more `mrv2-jax serve` argument")
    p.add_argument("--vllm-model", default=None, help="also time `vllm serve` of this model directory")
    p.add_argument("--vllm-site", default=None)
    p.add_argument("--vllm-python", default=sys.executable)
    p.add_argument("--vllm-arg", action="append", default=[])
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="first-token-")
    cache = tempfile.mkdtemp(prefix="first-token-cache-")  # empty: the first start is cold
    mrv2 = [sys.executable, "-m", "mrv2_jax.entrypoints.cli", "serve", "--model", args.model,
            "--served-model-name", "model", "--log-level", "info",
            *(["--load-format", args.load_format] if args.load_format else []),
            *(["--tokenizer", args.tokenizer] if args.tokenizer else []), *args.serve_arg]
    env = envs.subprocess_env(MRV2_COMPILATION_CACHE=cache)
    results = {}
    for start in ("cold", "warm"):
        log = os.path.join(log_dir, f"first_token_mrv2_{start}.log")
        results[f"mrv2 {start}"] = time_to_first_token(mrv2, env, "model", log, args.timeout) | {
            "startup_report": startup_report_line(log)}
    if args.vllm_model:
        vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model,
                "--served-model-name", "model", *(["--load-format", args.load_format] if args.load_format else []),
                *args.vllm_arg]
        vargs = argparse.Namespace(vllm_site=args.vllm_site)
        for start in ("first", "second"):  # vLLM keeps its own compile cache under ~/.cache/vllm
            log = os.path.join(log_dir, f"first_token_vllm_{start}.log")
            results[f"vllm {start}"] = time_to_first_token(vllm, vllm_env(vargs, "1"), "model", log, args.timeout)
    print(f"{'server, start':18} {'/health s':>10} {'first token s':>14}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:18} {r['error']}")
        else:
            print(f"{name:18} {r['health_s']:10.1f} {r['first_token_s']:14.1f}")
    report = {**describe_environment(probe_device=False), "settings": vars(args), "results": results}
    print(json.dumps({k: r.get("startup_report") for k, r in results.items() if r.get("startup_report")}, indent=1))
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
