"""CPU time the API server processes spend per streamed token, beside the engine process's.

    python -m benchmarks.api_process_cost --model demo --streams 32 --max-tokens 128 --api-server-count 1 2

Launches `mrv2-jax serve` (bench/serve.py's LaunchedServer; engine flags as `serve` takes them)
once per `--api-server-count` value, drives it with `--streams` concurrent streaming completions
(httpx, in this process), and reads each server process's CPU seconds (user + system, /proc)
before and after. The engine process is told apart from the API processes by its thread count
(XLA's thread pools). An API process that needs more CPU seconds per second than one core has is
the serving bottleneck: tokens per second per API process <= 1e6 / (µs per token).
"""

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from mrv2_jax.bench import sched_stats
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.bench.serve import LaunchedServer, free_port
from mrv2_jax.entrypoints.cli import add_engine_args

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def server_processes(pid: int) -> tuple[int, list[int]]:
    """(engine pid, API process pids) of a running `mrv2-jax serve`."""
    spawned = [c for c in sched_stats.children(pid)
               if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
    engine = sched_stats.engine_pid(pid)
    return engine, [pid] + [c for c in spawned if c != engine]


async def drive(url: str, streams: int, max_tokens: int, model: str) -> tuple[int, float]:
    """(tokens streamed, wall seconds) of `streams` concurrent streaming completions."""
    async def one(http, i):
        body = {"model": model, "prompt": f"Request {i}: the king said", "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[len("data: "):]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
        return tokens

    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as http:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(http, i) for i in range(streams)))
        return sum(counts), time.perf_counter() - start


def measure(args, count: int) -> dict:
    log = os.path.join(tempfile.gettempdir(), f"api_process_cost_{count}.log")
    launcher = LaunchedServer(args, "127.0.0.1", free_port("127.0.0.1"), log, args.startup_timeout)
    launcher.command += ["--api-server-count", str(count)]
    with launcher as server:
        asyncio.run(drive(server.url, min(args.streams, 4), 4, args.model))  # warm-up: every program in use
        engine, api = server_processes(server.process.pid)
        before = {p: cpu_seconds(p) for p in [engine, *api]}
        tokens, wall = asyncio.run(drive(server.url, args.streams, args.max_tokens, args.model))
        used = {p: cpu_seconds(p) - before[p] for p in before}
    api_cpu = sum(used[p] for p in api)
    return {"api_server_count": count, "streams": args.streams, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "engine_cpu_s": used[engine], "api_cpu_s": api_cpu,
            "api_cpu_s_per_process": [used[p] for p in api],
            "api_us_per_token": 1e6 * api_cpu / tokens, "engine_us_per_token": 1e6 * used[engine] / tokens,
            "api_busiest_process_load": max(used[p] for p in api) / wall}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--api-server-count", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--output-json", default=None)
    add_engine_args(p, compile_mode="eager")
    args = p.parse_args(argv)
    runs = [measure(args, count) for _ in range(args.repeats) for count in args.api_server_count]
    print(f"{'API procs':>9} {'tok/s':>8} {'API µs/tok':>11} {'engine µs/tok':>14} {'busiest API load':>17}")
    for count in args.api_server_count:
        mine = [r for r in runs if r["api_server_count"] == count]
        med = {k: statistics.median(r[k] for r in mine) for k in ("tokens_per_s", "api_us_per_token",
                                                                   "engine_us_per_token", "api_busiest_process_load")}
        print(f"{count:9d} {med['tokens_per_s']:8.0f} {med['api_us_per_token']:11.1f} "
              f"{med['engine_us_per_token']:14.1f} {med['api_busiest_process_load']:17.2f}")
    report = {**describe_environment(probe_device=False), "settings": vars(args), "runs": runs}
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
