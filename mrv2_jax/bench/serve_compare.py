"""Online serving side by side: `mrv2-jax serve` and `vllm serve` on the same GPU, one after the
other, driven by the same streaming client at each concurrency; one JSON table and one plot.

    mrv2-jax bench serve-compare --model qwen3-0.6b --load-format dummy --tokenizer /tmp/qwen3-0.6b \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 1024 \
        --input-len 128 --output-len 512 --concurrency 1 8 32 128 256 \
        --vllm-site /tmp/site --vllm-model /tmp/qwen3-0.6b --output-json serve_compare.json --plot serve_compare.png

The client is vLLM's own `bench serve` (`--client vllm`, the default where vLLM imports) or
`mrv2-jax bench serve` (`--client mrv2`). At concurrency C it runs ceil(C / --streams-per-client)
client processes side by side, each with its share of the streams and prompts, so that one
client process is not the bottleneck; their per-request records are pooled into one set of
metrics (output tok/s over the slowest process's duration, mean TTFT / TPOT / ITL, P99 ITL).
The client processes start once, with the first server, and serve every level of every server
(bench/client_pool.py): no level waits for a client's imports. Each client process's CPU time per
wall second during its run (its last `duration` seconds, sampled from /proc: without its set-up
for the run) is recorded: near 1.0 means that client was busy all the time and may have held the
server back (the table says so).

vLLM is found as `bench compare` finds it (`--vllm-python`, `--vllm-site`; ../shared/peers/vllm).
`--mrv2-base-url` measures an already running mrv2-jax server instead of launching one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mrv2_jax.bench import sched_stats
from mrv2_jax.bench.client_pool import ClientPool
from mrv2_jax.bench.compare import vllm_available, vllm_env
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.bench.serve import CLIENT_BUSY, LaunchedServer, free_port
from mrv2_jax.bench.server_histograms import count, quantile, scrape
from mrv2_jax.entrypoints.cli import add_engine_args

SERVERS = ("mrv2", "vllm")
# mrv2-jax's own view of each level, from its /metrics: the gaps between a request's outputs as the
# server sent them, and between engine steps' outputs reaching the API process, and the host time of
# handing each step to the runner. Beside the client's ITL they place a long gap: in the engine step
# (or the next step's hand-over), after it in the server, or past the server.
STEP_INTERVAL = "mrv2_step_output_interval_seconds"
STEP_DISPATCH = "mrv2_step_dispatch_seconds"
STEP_DISPATCH_OFF_CPU = "mrv2_step_dispatch_off_cpu_seconds"  # of it, the engine thread waiting, not working
STEP_DISPATCH_CALL = "mrv2_step_dispatch_call_seconds"  # of it, inside the compiled calls (the rest: Python)
# The engine process's side of the step interval (its messages' send times) and the API side (from a
# message leaving the engine to its outputs reaching their streams): which of the two a long gap is in.
ENGINE_INTERVAL = "mrv2_engine_step_interval_seconds"
STEP_DELIVERY = "mrv2_step_output_delivery_seconds"
SERVER_GAPS = {"server_itl": "mrv2_inter_token_latency_seconds", "step_interval": STEP_INTERVAL,
               "decode_step_interval": f'{STEP_INTERVAL}{{step="decode"}}',
               "prefill_step_interval": f'{STEP_INTERVAL}{{step="prefill"}}',
               "decode_dispatch": f'{STEP_DISPATCH}{{step="decode"}}',
               "prefill_dispatch": f'{STEP_DISPATCH}{{step="prefill"}}',
               "decode_dispatch_off_cpu": f'{STEP_DISPATCH_OFF_CPU}{{step="decode"}}',
               "decode_dispatch_call": f'{STEP_DISPATCH_CALL}{{step="decode"}}',
               "engine_decode_interval": f'{ENGINE_INTERVAL}{{step="decode"}}',
               "decode_delivery": f'{STEP_DELIVERY}{{step="decode"}}'}


class LaunchedVllm(LaunchedServer):
    """`vllm serve` (its OpenAI API server module) in a subprocess, like LaunchedServer."""

    def __init__(self, args, host: str, port: int, log_path: str, timeout: float):
        self.url = f"http://{host}:{port}"
        self.command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model,
                        "--host", host, "--port", str(port), "--served-model-name", args.served_model_name,
                        "--max-num-seqs", str(args.max_num_seqs),
                        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                        *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
                        *(["--load-format", "dummy"] if args.load_format == "dummy" else []),
                        *args.vllm_arg]
        self.log_path, self.timeout = log_path, timeout
        self.env = vllm_env(args, "1")


def client_argv(args, client: str, url: str, streams: int, prompts: int, seed: int, out: str) -> list[str]:
    """The command-line arguments of one client run (vLLM's `bench serve` or mrv2-jax's)."""
    if client == "vllm":
        out_dir, name = os.path.split(out)
        return ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
                "--model", args.served_model_name, "--tokenizer", args.client_tokenizer,
                "--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len), "--num-prompts", str(prompts),
                "--max-concurrency", str(streams), "--seed", str(seed), "--disable-tqdm",
                "--save-result", "--save-detailed", "--result-dir", out_dir, "--result-filename", name,
                *(["--ignore-eos"] if args.ignore_eos else [])]
    return ["--base-url", url, "--model", args.model or "demo",
            "--served-model-name", args.served_model_name, "--vocab-size", str(args.vocab_size),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--num-prompts", str(prompts),
            "--max-concurrency", str(streams), "--dataset-seed", str(seed), "--disable-tqdm", "--save-detailed",
            "--output-json", out, *(["--ignore-eos"] if args.ignore_eos else [])]


def client_processes(args, concurrency: int) -> int:
    return max(1, math.ceil(concurrency / args.streams_per_client))


def client_pool(args, client: str, log_dir: str) -> ClientPool:
    """Enough client workers for the largest level, started now (their imports overlap the first
    server's start-up) and shared by every server and level."""
    size = client_processes(args, max(args.concurrency))
    if client == "vllm":
        return ClientPool("vllm", size, log_dir, python=args.vllm_python, env=vllm_env(args, "1"))
    return ClientPool("mrv2", size, log_dir)


def read_client_result(client: str, path: str) -> tuple[list[dict], float, list[str]]:
    """-> (per request {ttft, itl, output_tokens} in seconds, the client's own run duration, the
    failed requests' errors)."""
    data = json.loads(Path(path).read_text())
    if client == "vllm":
        errors = data.get("errors") or [""] * len(data["ttfts"])
        per_request = zip(data["ttfts"], data["itls"], data["output_lens"], errors)
        rows = [{"ttft": t, "itl": list(itl), "output_tokens": n} for t, itl, n, e in per_request if not e and n]
        failed = [e or "no output tokens" for e, n in zip(errors, data["output_lens"]) if e or not n]
        return rows, float(data["duration"]), failed
    rows = [{"ttft": r["ttft"], "itl": r["itl"], "output_tokens": r["output_tokens"]}
            for r in data["requests"] if r["success"]]
    failed = [r.get("error") or "failed" for r in data["requests"] if not r["success"]]
    return rows, float(data["metrics"]["duration_s"]), failed


def pooled_metrics(rows: list[dict], duration: float) -> dict:
    """Metrics over the pooled requests of all client processes (milliseconds). `tokens_per_chunk`:
    output tokens per streamed chunk (a request's chunks: its ITL gaps + 1); above 1 when the server
    sent some tokens together, each such chunk after a gap of several steps (what lifts P99 ITL)."""
    ttft = np.asarray([r["ttft"] for r in rows] or [0.0]) * 1e3
    itl = np.asarray([x for r in rows for x in r["itl"]] or [0.0]) * 1e3
    tpot = np.asarray([sum(r["itl"]) / (r["output_tokens"] - 1) for r in rows if r["output_tokens"] > 1] or [0.0]) * 1e3
    out_tokens = sum(r["output_tokens"] for r in rows)
    chunks = sum(len(r["itl"]) + 1 for r in rows)
    return {"completed": len(rows), "output_tokens": out_tokens, "duration_s": duration,
            "output_throughput": out_tokens / duration if duration else 0.0,
            "mean_ttft_ms": float(ttft.mean()), "median_ttft_ms": float(np.median(ttft)),
            "p99_ttft_ms": float(np.percentile(ttft, 99)), "max_ttft_ms": float(ttft.max()),
            "mean_tpot_ms": float(tpot.mean()),
            "mean_itl_ms": float(itl.mean()), "p99_itl_ms": float(np.percentile(itl, 99)),
            "tokens_per_chunk": out_tokens / chunks if chunks else 0.0}


def run_clients(args, pool: ClientPool, client: str, url: str, concurrency: int, work_dir: str,
                prompts: int | None = None) -> dict:
    """One concurrency level: the pool's client workers side by side -> pooled metrics + client load.
    `prompts`: how many in all (default: --prompts-per-stream per stream, at least --min-prompts)."""
    processes = client_processes(args, concurrency)
    if prompts is None:
        prompts = max(args.min_prompts, args.prompts_per_stream * concurrency)
    argvs, outs = [], []
    for i in range(processes):
        streams = concurrency // processes + (i < concurrency % processes)
        n = prompts // processes + (i < prompts % processes)
        outs.append(os.path.join(work_dir, f"client_{concurrency}_{i}.json"))
        Path(outs[-1]).unlink(missing_ok=True)  # the other server's run of this level wrote the same name
        argvs.append(client_argv(args, client, url, streams, n, args.dataset_seed + i, outs[-1]))
    runs = pool.run(argvs)
    if errors := [run.error for run in runs if run.error]:
        raise RuntimeError(f"{len(errors)} client run(s) failed at concurrency {concurrency}: {errors[0]}")
    rows, durations, busy, busy_run, failed = [], [], [], [], []
    for run, out in zip(runs, outs):
        got, duration, failures = read_client_result(client, out)
        rows += got
        failed += failures
        durations.append(duration)
        busy.append(run.cpu_s / run.wall_s)
        busy_run.append(run.sampler.busy_over_last(duration))
    metrics = pooled_metrics(rows, max(durations))
    # The run's own load (its last `duration` seconds) where it could be sampled, else the whole run's
    # (the client's set-up for the run, its dataset and tokenizer, included).
    run_busy = [b for b in busy_run if b is not None]
    busy_max = max(run_busy) if len(run_busy) == len(busy_run) else max(busy)
    # Failed requests are left out of the metrics and counted here, with the first one's error.
    metrics |= {"failed": len(failed), "first_error": failed[0][:300] if failed else None}
    metrics |= {"concurrency": concurrency, "client_processes": processes, "prompts": prompts,
                "client_cpu_busy_max": busy_max, "client_cpu_busy_whole_max": max(busy),
                "client_cpu_busy_is_run": len(run_busy) == len(busy_run), "client_may_be_bound": busy_max > CLIENT_BUSY}
    return metrics


def measure_level(args, pool: ClientPool, server: str, client: str, url: str, concurrency: int, work_dir: str,
                  server_pid: int | None = None) -> dict:
    """One level's client metrics, and for mrv2-jax the P50 / P99 of its SERVER_GAPS over the level
    (the steps' hand-over to the runner among them) and the share of step intervals that ended with a
    step computing prompt tokens; for a server launched here, how the OS scheduled its processes."""
    names = ("mrv2_inter_token_latency_seconds", STEP_INTERVAL, STEP_DISPATCH, STEP_DISPATCH_OFF_CPU,
             STEP_DISPATCH_CALL, ENGINE_INTERVAL, STEP_DELIVERY)
    before = scrape(url, names, by="step") if server == "mrv2" else None
    sched_before, t0 = (sched_stats.snapshot(server_pid), time.perf_counter()) if server_pid else (None, 0.0)
    metrics = run_clients(args, pool, client, url, concurrency, work_dir)
    if sched_before is not None:
        engine = sched_stats.engine_pid(server_pid)
        metrics["sched"] = sched_stats.delta(sched_before, sched_stats.snapshot(server_pid),
                                             time.perf_counter() - t0, engine)
    if before is not None:
        after = scrape(url, names, by="step")
        for key, name in SERVER_GAPS.items():
            for q in (50, 99):
                value = quantile(before.get(name), after.get(name, {}), q / 100)
                metrics[f"{key}_p{q}_ms"] = None if value is None else 1e3 * value
        steps = count(before.get(STEP_INTERVAL), after.get(STEP_INTERVAL, {}))
        prefill = SERVER_GAPS["prefill_step_interval"]
        metrics["prefill_step_share"] = count(before.get(prefill), after.get(prefill, {})) / steps if steps else None
    return metrics


def warm_up(args, pool: ClientPool, client: str, url: str, work_dir: str) -> dict | None:
    """A discarded round at the largest concurrency, --warmup-prompts-per-stream per stream, so that
    the first measured level does not pay for a fresh server's first requests (allocator, caches,
    the client processes' own start)."""
    if not args.warmup_prompts_per_stream:
        return None
    c = max(args.concurrency)
    m = run_clients(args, pool, client, url, c, work_dir, prompts=args.warmup_prompts_per_stream * c)
    return {"concurrency": c, "prompts": m["prompts"], "duration_s": m["duration_s"], "failed": m["failed"]}


def run_server(args, pool: ClientPool, server: str, client: str, work_dir: str) -> dict:
    if server == "mrv2" and args.mrv2_base_url:
        url = args.mrv2_base_url
        warm = warm_up(args, pool, client, url, work_dir)
        return {"startup_s": None, "warmup": warm,
                "levels": [measure_level(args, pool, server, client, url, c, work_dir) for c in args.concurrency]}
    port = free_port(args.host)
    log = os.path.join(args.log_dir or work_dir, f"serve_compare_{server}.log")
    launcher = (LaunchedServer if server == "mrv2" else LaunchedVllm)(args, args.host, port, log, args.server_timeout)
    if server == "mrv2":
        launcher.command += ["--served-model-name", args.served_model_name, *args.mrv2_serve_arg]
    with launcher as s:
        warm, levels = warm_up(args, pool, client, s.url, work_dir), []
        for c in args.concurrency:
            levels.append(measure_level(args, pool, server, client, s.url, c, work_dir, server_pid=s.process.pid))
            m = levels[-1]
            print(f"{server:5} C={c:4}: {m['output_throughput']:9.0f} out tok/s, TTFT {m['mean_ttft_ms']:7.1f} ms "
                  f"(median {m['median_ttft_ms']:.1f}, max {m['max_ttft_ms']:.1f}), "
                  f"TPOT {m['mean_tpot_ms']:6.2f} ms, ITL {m['mean_itl_ms']:6.2f} / P99 {m['p99_itl_ms']:6.1f} ms, "
                  f"tokens/chunk {m['tokens_per_chunk']:.3f}, client busy {m['client_cpu_busy_max']:.2f}", flush=True)
            if m.get("server_itl_p99_ms") is not None:
                print(f"{server:5} C={c:4}: at the server: ITL P50 {m['server_itl_p50_ms']:.2f} / P99 "
                      f"{m['server_itl_p99_ms']:.2f} ms, step outputs every P50 {m['step_interval_p50_ms']:.2f} / "
                      f"P99 {m['step_interval_p99_ms']:.2f} ms", flush=True)
                print(f"{server:5} C={c:4}: steps with prompt tokens {100 * (m['prefill_step_share'] or 0):.1f}% "
                      f"of intervals, P50 {_ms(m['prefill_step_interval_p50_ms'])} / P99 "
                      f"{_ms(m['prefill_step_interval_p99_ms'])} ms; decode-only P50 "
                      f"{_ms(m['decode_step_interval_p50_ms'])} / P99 {_ms(m['decode_step_interval_p99_ms'])} ms",
                      flush=True)
                print(f"{server:5} C={c:4}: host hand-over of a step to the runner: with prompt tokens P50 "
                      f"{_ms(m['prefill_dispatch_p50_ms'])} / P99 {_ms(m['prefill_dispatch_p99_ms'])} ms; decode-only "
                      f"P50 {_ms(m['decode_dispatch_p50_ms'])} / P99 {_ms(m['decode_dispatch_p99_ms'])} ms "
                      f"(off the CPU: P50 {_ms(m['decode_dispatch_off_cpu_p50_ms'])} / "
                      f"P99 {_ms(m['decode_dispatch_off_cpu_p99_ms'])} ms; in the compiled calls: P50 "
                      f"{_ms(m['decode_dispatch_call_p50_ms'])} / P99 {_ms(m['decode_dispatch_call_p99_ms'])} ms)",
                      flush=True)
                print(f"{server:5} C={c:4}: decode steps leaving the engine process every P50 "
                      f"{_ms(m['engine_decode_interval_p50_ms'])} / P99 {_ms(m['engine_decode_interval_p99_ms'])} ms; "
                      f"their delivery to the streams P50 {_ms(m['decode_delivery_p50_ms'])} / P99 "
                      f"{_ms(m['decode_delivery_p99_ms'])} ms", flush=True)
            engine_rows = [row for row in (m.get("sched") or {}).values() if row["engine"]]
            if engine_rows:
                e = engine_rows[0]
                print(f"{server:5} C={c:4}: engine process main thread per second: CPU {e['main_cpu_s_per_s']:.3f} s, "
                      f"waiting for a CPU {1e3 * e['main_runqueue_wait_s_per_s']:.2f} ms, "
                      f"preempted {e['main_preempted_per_s']:.1f} times", flush=True)
            if m["failed"]:
                print(f"{server:5} C={c:4}: {m['failed']} request(s) FAILED, first: {m['first_error']}", flush=True)
        return {"startup_s": s.startup_s, "warmup": warm, "levels": levels}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_throughput", "output tok/s"), ("mean_ttft_ms", "mean TTFT ms"),
              ("mean_tpot_ms", "mean TPOT ms"), ("p99_itl_ms", "P99 ITL ms"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, title) in zip(axes, panels):
        for server, result in report["results"].items():
            levels = result.get("levels") or []
            ax.plot([m["concurrency"] for m in levels], [m[key] for m in levels], marker="o", label=server)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser(prog=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="mrv2,vllm", help="comma-separated: mrv2, vllm (in this order)")
    p.add_argument("--client", choices=("vllm", "mrv2", "auto"), default="auto",
                   help="the streaming client (auto: vLLM's where it imports, else mrv2-jax's)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument("--streams-per-client", type=int, default=16,
                   help="streams per client process (one Python client process keeps up with a few streams only)")
    p.add_argument("--prompts-per-stream", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--warmup-prompts-per-stream", type=int, default=1,
                   help="a discarded round at the largest concurrency before the measured levels (0: none)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dataset-seed", type=int, default=0, help="client process i uses seed + i")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--served-model-name", default="model")
    p.add_argument("--vocab-size", type=int, default=None, help="mrv2 client: prompt ids below this "
                   "(default: from --model's config.json)")
    p.add_argument("--client-tokenizer", default=None, help="vLLM client's tokenizer (default: --vllm-model)")
    p.add_argument("--server-timeout", type=float, default=1800.0)
    p.add_argument("--mrv2-base-url", default=None, help="measure this running mrv2-jax server instead")
    p.add_argument("--vllm-python", default=sys.executable)
    p.add_argument("--vllm-site", default=None, help="extra site dir with vLLM (the offline payload's /tmp/site)")
    p.add_argument("--vllm-model", default=None, help="model dir for vLLM (config + tokenizer)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    p.add_argument("--mrv2-serve-arg", action="append", default=[],
                   help="extra `mrv2-jax serve` argument (repeatable), e.g. --mrv2-serve-arg=--api-server-count=4")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None)
    add_engine_args(p, compile_mode="eager")
    return p


def run(args) -> dict:
    servers = [s for s in args.servers.split(",") if s]
    if unknown := set(servers) - set(SERVERS):
        raise ValueError(f"unknown server(s) {sorted(unknown)}; choose from {SERVERS}")
    needs_vllm = "vllm" in servers or args.client == "vllm"
    ok, vllm_version = vllm_available(args) if needs_vllm or args.client == "auto" else (False, "not asked for")
    if needs_vllm and not ok:
        raise RuntimeError(f"vLLM is needed (--servers/--client) but {vllm_version}")
    client = args.client if args.client != "auto" else ("vllm" if ok else "mrv2")
    if client == "vllm" and not (args.client_tokenizer or args.vllm_model):
        raise ValueError("the vLLM client needs --client-tokenizer or --vllm-model")
    args.client_tokenizer = args.client_tokenizer or args.vllm_model
    if client == "mrv2" and args.vocab_size is None:
        from mrv2_jax.bench.dataset import vocab_size_of
        from mrv2_jax.models.loader import resolve_model_path

        args.vocab_size = vocab_size_of(resolve_model_path(args.model))
    report = {**describe_environment(probe_device=False), "client": client,
              "vllm_version": vllm_version if ok else None, "settings": dict(vars(args)), "results": {}}
    with tempfile.TemporaryDirectory(prefix="mrv2-serve-compare-") as work_dir, \
            client_pool(args, client, args.log_dir or work_dir) as pool:
        for server in servers:
            report["results"][server] = run_server(args, pool, server, client, work_dir)
            if args.output_json:  # after each server: a run cut short keeps the servers it finished
                write_report(report, args.output_json)
    if args.plot:
        plot(report, args.plot)
    return report


def main(argv=None, prog=None):
    return run(build_parser(prog).parse_args(argv))


if __name__ == "__main__":
    main()
