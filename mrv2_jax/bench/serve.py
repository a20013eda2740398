"""Online serving benchmark, in the manner of `vllm bench serve`: random token prompts streamed to
an OpenAI-compatible /v1/completions endpoint by an asyncio client, at a request rate (Poisson
arrivals, or all at once) under a concurrency cap; reports request and token throughput and the
latency distributions (TTFT, TPOT, ITL, E2E).

    mrv2-jax bench serve --base-url http://127.0.0.1:8000 --model qwen3-0.6b \
        --input-len 128 --output-len 512 --num-prompts 1000 --max-concurrency 256 --ignore-eos

With --launch-server it starts `mrv2-jax serve` itself with the engine arguments given here
(--model, --load-format, --max-num-seqs, ...), waits for /health, runs, and stops it:

    mrv2-jax bench serve --launch-server --model qwen3-0.6b --load-format dummy \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 1024 \
        --input-len 128 --output-len 512 --num-prompts 1000 --max-concurrency 256 --ignore-eos

Streams are measured per server-sent chunk, as vllm does: TTFT = first chunk, ITL = the gaps
between chunks, TPOT = (E2E - TTFT) / (output tokens - 1), output tokens from the stream's usage
record. A server streams decoded text, so it needs a tokenizer to send a chunk per token: a
preset without one (qwen3-0.6b) streams everything at the end; pass --tokenizer DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Self

import numpy as np

from mrv2_jax import envs
from mrv2_jax.bench.dataset import random_prompts, vocab_size_of
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.entrypoints.cli import add_engine_args, engine_kwargs

METRICS = ("ttft", "tpot", "itl", "e2el")
TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
# A client process this busy (CPU seconds per wall second) may have been the bottleneck.
CLIENT_BUSY = 0.85


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first chunk
    e2el: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between successive chunks
    start: float = 0.0  # perf_counter at sending (for concurrency over time)


# --- one request ----------------------------------------------------------------------------
async def stream_completion(client, url: str, body: dict, prompt_len: int, headers: dict) -> RequestResult:
    """POST one streaming completion and time its chunks."""
    result = RequestResult(prompt_len=prompt_len)
    chunks, usage_tokens = 0, None
    start = last = result.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {event['error'].get('message', event['error'])}"
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                choices = event.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("finish_reason")):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks, last = chunks + 1, now
        result.e2el = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - a failed request is counted and reported, not fatal
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.success = chunks > 0
    if not result.success:
        result.error = "the stream ended without a chunk"
    return result


# --- the run ---------------------------------------------------------------------------------
async def arrival_times(num: int, rate: float, seed: int):
    """Yield request indices at Poisson arrivals of `rate` per second (all at once if inf)."""
    rng = np.random.default_rng(seed)
    for i in range(num):
        yield i
        if rate != float("inf"):
            await asyncio.sleep(rng.exponential(1.0 / rate))


async def run_requests(base_url: str, endpoint: str, bodies: list[dict], prompt_lens: list[int], *,
                       request_rate: float, max_concurrency: int | None, seed: int, api_key: str | None,
                       progress: bool) -> tuple[list[RequestResult], float]:
    """Send every body; returns the results (in request order) and the wall time of the run."""
    import httpx
    from tqdm import tqdm

    limit = max_concurrency or len(bodies)
    # The connection pool must not be the bottleneck: one connection per concurrent stream.
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    semaphore = asyncio.Semaphore(limit)
    bar = tqdm(total=len(bodies), disable=not progress, desc="requests")
    results: list[RequestResult | None] = [None] * len(bodies)

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(None)) as client:
        async def one(i):
            async with semaphore:
                results[i] = await stream_completion(client, endpoint, bodies[i], prompt_lens[i], headers)
            bar.update(1)

        start = time.perf_counter()
        tasks = [asyncio.ensure_future(one(i)) async for i in arrival_times(len(bodies), request_rate, seed)]
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


def peak_concurrency(results: list[RequestResult]) -> int:
    """The most requests in flight at once, from their start and end times."""
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.e2el, -1) for r in results])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    """The metrics of a run, times in milliseconds, in vllm's naming (mean_ttft_ms, p99_itl_ms)."""
    ok = [r for r in results if r.success]
    in_tokens = sum(r.prompt_len for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    m = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
         "total_token_throughput": (in_tokens + out_tokens) / duration,
         "max_concurrent_requests": peak_concurrency(ok),
         "total_chunks": sum(len(r.itl) + 1 for r in ok)}
    samples = {"ttft": [r.ttft for r in ok], "e2el": [r.e2el for r in ok],
               "tpot": [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
               "itl": [x for r in ok for x in r.itl]}
    for name in METRICS:
        ms = np.asarray(samples[name] or [0.0]) * 1e3
        m[f"mean_{name}_ms"], m[f"median_{name}_ms"] = float(ms.mean()), float(np.median(ms))
        m[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            m[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return m


def format_report(m: dict, max_concurrency, percentiles: list[float]) -> str:
    line = lambda label, value: f"{label:<40}{value:<10}"
    rows = [f"{' Serving Benchmark Result ':=^50}",
            line("Successful requests:", m["completed"]),
            line("Failed requests:", m["failed"]),
            line("Maximum request concurrency:", max_concurrency or "unlimited"),
            line("Peak concurrent requests:", m["max_concurrent_requests"]),
            line("Benchmark duration (s):", f"{m['duration_s']:.2f}"),
            line("Total input tokens:", m["total_input_tokens"]),
            line("Total generated tokens:", m["total_output_tokens"]),
            line("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
            line("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
            line("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}"),
            line("Client CPU busy (of wall time):", f"{m['client_cpu_busy']:.2f}")]
    for name in METRICS:
        label = LABELS[name]
        rows.append(f"{TITLES[name]:-^50}")
        rows.append(line(f"Mean {label} (ms):", f"{m[f'mean_{name}_ms']:.2f}"))
        rows.append(line(f"Median {label} (ms):", f"{m[f'median_{name}_ms']:.2f}"))
        for p in percentiles:
            rows.append(line(f"P{p:g} {label} (ms):", f"{m[f'p{p:g}_{name}_ms']:.2f}"))
    rows.append("=" * 50)
    return "\n".join(rows)


# --- a server of our own -------------------------------------------------------------------
def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_argv(args) -> list[str]:
    """The engine arguments of this command, as `mrv2-jax serve` options."""
    argv = []
    for name, value in engine_kwargs(args).items():
        if value is None:
            continue
        if name == "async_scheduling":
            argv += [] if value else ["--no-async-scheduling"]
        elif name == "enable_prefix_caching":
            argv += [] if value else ["--no-prefix-caching"]
        elif name == "program_store":  # on or off, default by device
            argv += ["--program-store" if value else "--no-program-store"]
        elif isinstance(value, bool):  # a switch that is off unless given (--enable-expert-parallel)
            argv += [f"--{name.replace('_', '-')}"] if value else []
        else:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


class LaunchedServer:
    """`mrv2-jax serve` in a subprocess, from start to /health ok, stopped on exit (Ctrl-C first,
    so it shuts the engine down; killed if that takes too long). Its output goes to `log_path`."""

    def __init__(self, args, host: str, port: int, log_path: str, timeout: float, log_level: str = "warning"):
        self.url = f"http://{host}:{port}"
        self.command = [sys.executable, "-m", "mrv2_jax.entrypoints.cli", "serve", "--host", host,
                        "--port", str(port), "--log-level", log_level, *engine_argv(args)]
        self.log_path, self.timeout = log_path, timeout
        self.env = None  # the server's environment (None: this process's)

    def __enter__(self) -> Self:
        import httpx

        print(f"launching: {' '.join(self.command)}\n  (log: {self.log_path})", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        t0 = time.perf_counter()
        while True:
            if self.process.poll() is not None:
                self._close()
                raise RuntimeError(f"the server exited with code {self.process.returncode} before it was "
                                   f"ready:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > self.timeout:
                self.__exit__()
                raise RuntimeError(f"the server was not ready after {self.timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - t0
        print(f"server ready in {self.startup_s:.1f} s", flush=True)
        return self

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-lines:])

    def _close(self):
        self._log.close()

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.send_signal(2)  # SIGINT: uvicorn's graceful stop, then the engine stops
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close()


# --- command line ------------------------------------------------------------------------------
def parse_rate(text: str) -> float:
    rate = float(text)
    if rate <= 0:
        raise argparse.ArgumentTypeError("the request rate must be > 0 (or inf)")
    return rate


def build_parser(prog=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("server")
    target.add_argument("--base-url", default=None, help="server URL, e.g. http://host:8000 (default: from "
                        "--host/--port)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=None, help="default 8000; with --launch-server a free port")
    target.add_argument("--endpoint", default="/v1/completions")
    target.add_argument("--api-key", default=envs.read("MRV2_API_KEY"), help="default: $MRV2_API_KEY")
    target.add_argument("--served-model-name", default=None,
                        help="the 'model' field of the requests (default: --model, or 'demo')")
    target.add_argument("--launch-server", action="store_true",
                        help="start `mrv2-jax serve` with the engine arguments below, run, and stop it")
    target.add_argument("--server-timeout", type=float, default=1200.0,
                        help="seconds to wait for a launched server's /health (compiles included)")
    target.add_argument("--server-log", default=None, help="where a launched server's output goes")

    data = p.add_argument_group("random dataset")
    data.add_argument("--input-len", type=int, default=128)
    data.add_argument("--output-len", type=int, default=128)
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-prefix-len", type=int, default=0)
    data.add_argument("--dataset-seed", type=int, default=0)
    data.add_argument("--vocab-size", type=int, default=None,
                      help="prompt token ids are drawn below this (default: from --model's config.json)")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=parse_rate, default=float("inf"),
                      help="requests per second, Poisson arrivals (default inf: all at once)")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--num-warmups", type=int, default=0, help="untimed requests before the run")
    load.add_argument("--arrival-seed", type=int, default=0)

    report = p.add_argument_group("report")
    report.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    report.add_argument("--output-json", default=None)
    report.add_argument("--save-detailed", action="store_true", help="also store every request's timings")
    report.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p, compile_mode="eager")
    return p


def run(args) -> dict:
    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x]
    if args.vocab_size is None:
        from mrv2_jax.models.loader import resolve_model_path

        try:
            args.vocab_size = vocab_size_of(resolve_model_path(args.model))
        except FileNotFoundError as e:
            raise ValueError(f"{e}; pass --vocab-size for a server whose model is not here") from None
    prompts = random_prompts(args.num_warmups + args.num_prompts, args.input_len, args.random_range_ratio,
                             args.vocab_size, args.dataset_seed, args.random_prefix_len)
    name = args.served_model_name or args.model or "demo"
    bodies = [{"model": name, "prompt": p, "max_tokens": args.output_len, "temperature": args.temperature,
               "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
              for p in prompts]
    lens = [len(p) for p in prompts]
    kw = {"max_concurrency": args.max_concurrency, "seed": args.arrival_seed, "api_key": args.api_key}

    def measure(base_url):
        if args.num_warmups:
            warm, _ = asyncio.run(run_requests(base_url, args.endpoint, bodies[: args.num_warmups],
                                               lens[: args.num_warmups], request_rate=float("inf"),
                                               progress=False, **kw))
            bad = [r.error for r in warm if not r.success]
            if bad:
                raise RuntimeError(f"{len(bad)} warm-up request(s) failed, e.g. {bad[0]}")
        cpu_start = time.process_time()
        results, duration = asyncio.run(run_requests(base_url, args.endpoint, bodies[args.num_warmups :],
                                                     lens[args.num_warmups :], request_rate=args.request_rate,
                                                     progress=not args.disable_tqdm, **kw))
        return results, duration, time.process_time() - cpu_start

    server_startup = None
    if args.launch_server:
        port = args.port or free_port(args.host)
        log = args.server_log or os.path.join(tempfile.gettempdir(), f"mrv2-serve-{port}.log")
        with LaunchedServer(args, args.host, port, log, args.server_timeout) as server:
            results, duration, cpu_s = measure(server.url)
            server_startup = server.startup_s
    else:
        results, duration, cpu_s = measure(args.base_url or f"http://{args.host}:{args.port or 8000}")

    metrics = summarize(results, duration, percentiles)
    # One asyncio client reads every stream: near a core's worth of CPU, it delays the chunks it reads.
    metrics["client_cpu_busy"] = cpu_s / duration
    metrics["client_may_be_bound"] = metrics["client_cpu_busy"] > CLIENT_BUSY
    print(format_report(metrics, args.max_concurrency, percentiles))
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} request(s) failed; first: {errors[0]}", file=sys.stderr)
    if metrics["client_may_be_bound"]:
        print(f"note: this client process was busy {metrics['client_cpu_busy']:.2f} of the run's wall time, so it may "
              "have held back the server and bunched its chunks (ITL); `mrv2-jax bench serve-compare --servers mrv2` "
              "spreads the streams over several client processes", file=sys.stderr)
    if metrics["completed"] and metrics["total_chunks"] < 0.5 * metrics["total_output_tokens"]:
        print(f"note: {metrics['total_chunks']} chunks for {metrics['total_output_tokens']} tokens: the server "
              "streams decoded text, and a model without a tokenizer only streams at the end (TTFT and ITL "
              "are per chunk); serve it with --tokenizer", file=sys.stderr)
    settings = {k: (str(v) if v == float("inf") else v) for k, v in vars(args).items()}  # JSON has no inf
    report = {**describe_environment(probe_device=False), "settings": settings | {"served_model_name": name},
              "server_startup_s": server_startup, "metrics": metrics,
              "errors": errors[:10]}
    if args.save_detailed:
        report["requests"] = [asdict(r) for r in results]
    if args.output_json:
        write_report(report, args.output_json)
    return report


def main(argv=None, prog=None):
    args = build_parser(prog).parse_args(argv)
    return run(args)


if __name__ == "__main__":
    main()
