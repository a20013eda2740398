"""The runner A/B: v1, v2-sync and v2-async on the same workload, in one process.

    mrv2-jax bench ab --model qwen3-0.6b --load-format dummy \
        --input-len 128 --output-len 512 --num-prompts 1000 --max-num-seqs 256 --output-json ab.json

Weights are loaded once and shared; each arm gets its own engine (KV cache, compiled buckets).
Besides throughput it reports, for V2, one steady-decode step (every row decoding at full
concurrency, the 100th such step): the step period around it (start of one `engine.step` to
the next, so output processing counts), the device time of that same step replayed alone on a
copy of its state (an upper bound: the replay adds a dispatch and a sync per call), and their
ratio, an estimate of the GPU busy fraction; `wall_profile` follows the period through the run.
`mrv2-jax bench timeline` measures the busy fraction from a profiler trace instead.
"""

import argparse
import gc
import itertools
import json
import statistics
import time

from mrv2_jax.bench import trace
from mrv2_jax.bench.capture import DecodeStepCapture, replay
from mrv2_jax.bench.dataset import random_prompts
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.bench.sampling import sampling_params
from mrv2_jax.bench.step_log import StepLog, attach_hooks
from mrv2_jax.entrypoints.cli import add_engine_args, engine_kwargs

ARMS = {"v1": ("v1", False), "v2-sync": ("v2", False), "v2-async": ("v2", True)}


def step_periods(step_log) -> list[tuple[float, int, int]]:
    """(seconds from this step's start to the next one's, tokens, rows) per step: the whole
    loop around `engine.step`, output processing included, which is what the GPU waits on."""
    return [(nxt[0] - cur[0], cur[2], cur[3]) for cur, nxt in zip(step_log, step_log[1:])]


def local_wall(step_log, index, num_reqs, window=10) -> float | None:
    """Median period of the full-concurrency decode steps within `window` steps of `index`."""
    near = step_periods(step_log)[max(index - window, 0) : index + window]
    walls = [period for period, tokens, reqs in near if tokens == reqs == num_reqs]
    return statistics.median(walls) if walls else None


def wall_profile(step_log, window=64) -> list[list]:
    """[first step, median period ms, median engine.step ms, median rows] per window of `window`
    steps: how the step time moves through the run (decode slows down as the context grows,
    prefills stand out) and how much of each period is spent outside `engine.step`."""
    periods = step_periods(step_log)
    out = []
    for i in range(0, len(periods), window):
        chunk = periods[i : i + window]
        inside = [e - s for s, e, _, _ in step_log[i : i + window]]
        out.append([i, round(1e3 * statistics.median(p for p, _, _ in chunk), 3),
                    round(1e3 * statistics.median(inside), 3), statistics.median(r for _, _, r in chunk)])
    return out


def run_arm(name, args, loaded, prompts):
    from mrv2_jax.llm import LLM

    runner, async_scheduling = ARMS[name]
    t0 = time.perf_counter()
    # The arms compare runners step by step (one step = one dispatch), so fused decode is off;
    # bench/fused_decode.py measures it.
    llm = LLM(loaded_model=loaded, **(engine_kwargs(args) | {"runner": runner, "async_scheduling": async_scheduling,
                                                             "max_fused_steps": 1}))
    llm.wait_for_compiles()  # no compile beside the timed steps
    startup = time.perf_counter() - t0
    params = sampling_params(args.sampling, args.output_len, loaded[0].vocab_size)
    llm.generate(prompts[: min(len(prompts), args.max_num_seqs)][:64], params, use_tqdm=False)  # warm-up
    engine = llm.engine
    rows = min(args.max_num_seqs, len(prompts))
    # V2: in the middle of steady decode, keep one full-concurrency decode step to replay it
    # alone afterwards: its device time. Both hooks log every step's interval and shape.
    capture = DecodeStepCapture(engine.runner, rows, args.capture_step) if runner == "v2" else None
    log = capture if capture is not None else StepLog()
    attach_hooks(engine, log)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    attach_hooks(engine, None)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    num_in = sum(len(p) for p in prompts)
    wall = device = enqueue = ahead = timeline = None
    if capture is not None and capture.captured:
        capture.restore_state()
        device, enqueue = replay(capture.dispatch, 20)
        capture.restore_state()  # the same 20 steps again (a longer context would cost more)
        ahead = device_time_host_ahead(capture.dispatch, 20)
        capture.restore_state()
        wall = local_wall(log.steps, capture.step_index, rows)
        if args.step_timeline:
            timeline = step_timeline(capture.dispatch)
            if timeline:  # (no device events on a CPU)
                timeline["back_to_back"] = back_to_back_timeline(capture.dispatch)
    return {"arm": name, "elapsed_s": elapsed, "startup_s": startup, "num_steps": len(log.steps),
            "output_tokens_per_s": num_out / elapsed, "total_tokens_per_s": (num_in + num_out) / elapsed,
            "requests_per_s": len(prompts) / elapsed, "steady_decode_rows": rows,
            "steady_step_wall_ms": wall and 1e3 * wall, "steady_step_device_ms": device and 1e3 * device,
            "replay_enqueue_ms": enqueue and 1e3 * enqueue,
            "steady_step_device_ms_host_ahead": ahead and 1e3 * ahead,
            "gpu_busy_fraction": (device / wall) if (wall and device) else None,
            "wall_profile": wall_profile(log.steps)} | ({"step_timeline": timeline} if timeline else {})


def device_time_host_ahead(dispatch, repeats: int) -> float | None:
    """The replayed step's time per step when the host has enqueued every step before the
    GPU reaches the first: a head start of GPU busy work (timed alone, then subtracted) goes
    first. Below the plain replay's time, the host was what held the replay back. GPU only
    (a CPU backend runs work as it is enqueued)."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        return None
    x = jnp.full((4096, 4096), 0.01, jnp.bfloat16)
    busy = jax.jit(lambda x: jax.lax.fori_loop(0, 400, lambda i, y: jnp.tanh(y @ x), x))
    jax.block_until_ready(busy(x))
    busy_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(busy(x))
        busy_s.append(time.perf_counter() - t0)
    total = replay(dispatch, repeats, head_start=lambda: busy(x))[0] * repeats
    return (total - statistics.median(busy_s)) / repeats


def step_timeline(dispatch) -> dict:
    """The device events of one replayed step (bench/trace.py `call_timeline`), with its span,
    its idle time, the longest gaps and the kernel families' time. Set
    XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true to keep the step's CUDA graphs
    (and their gaps) as they are outside the profiler."""
    events = trace.call_timeline(lambda: replay(dispatch, 1), ())
    if not events:
        return {}
    families: dict[str, float] = {}
    for e in events:
        families[trace.kernel_family(e["kernel"])] = families.get(trace.kernel_family(e["kernel"]), 0.0) + e["us"]
    gaps = sorted(events, key=lambda e: -e["gap_us"])[:12]
    return {"span_us": round(events[-1]["at_us"] + events[-1]["us"], 1),
            "idle_us": round(sum(e["gap_us"] for e in events), 1), "num_events": len(events),
            "largest_gaps": [{"gap_us": e["gap_us"], "at_us": e["at_us"], "before": e["kernel"]} for e in gaps],
            "kernel_us": {k: round(v, 1) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
            "events": events}


def back_to_back_timeline(dispatch, steps: int = 4) -> dict:
    """`steps` replays enqueued back to back, as the replayed device time runs them: the mean
    period (first event to last over steps), the idle time per step and the longest gaps, with
    the kernels around them. Gaps that one replayed step does not show (a step waiting on the
    host, a sync inside it) show here."""
    events = trace.call_timeline(lambda: replay(dispatch, steps), ())
    if not events:
        return {}
    gaps = sorted(range(1, len(events)), key=lambda i: -events[i]["gap_us"])[:8]
    # Idle per step by the kernel families on either side: where a step's idle time sits.
    by_pair: dict[str, float] = {}
    for prev, e in itertools.pairwise(events):
        pair = f"{trace.kernel_family(prev['kernel'])} -> {trace.kernel_family(e['kernel'])}"
        by_pair[pair] = by_pair.get(pair, 0.0) + e["gap_us"] / steps
    return {"steps": steps, "period_us": round((events[-1]["at_us"] + events[-1]["us"]) / steps, 1),
            "idle_us_per_step": round(sum(e["gap_us"] for e in events) / steps, 1),
            "largest_gaps": [{"gap_us": events[i]["gap_us"], "at_us": events[i]["at_us"],
                              "after": events[i - 1]["kernel"], "before": events[i]["kernel"]} for i in gaps],
            "idle_us_per_step_by_pair": {k: round(v, 1)
                                         for k, v in sorted(by_pair.items(), key=lambda kv: -kv[1])[:20]}}


def print_step_timeline(arm: str, t: dict, top: int = 25) -> None:
    print(f"\n{arm}: one replayed step, {t['span_us']:.0f} us from first to last device event, "
          f"{t['idle_us']:.0f} us idle, {t['num_events']} events")
    for name, us in list(t["kernel_us"].items())[:top]:
        print(f"  {name[:60]:60} {us:9.1f} us")
    print("  largest idle gaps (us, before): " + ", ".join(
        f"{g['gap_us']:.0f} ({g['before'][:30]})" for g in t["largest_gaps"]))
    b = t.get("back_to_back")
    if b:
        print(f"  {b['steps']} replays back to back: {b['period_us']:.0f} us per step, "
              f"{b['idle_us_per_step']:.0f} us idle per step; largest gaps (us, after -> before): " + ", ".join(
                  f"{g['gap_us']:.0f} ({g['after'][:24]} -> {g['before'][:24]})" for g in b["largest_gaps"]))
        print("  idle per step by neighbours (us): " + ", ".join(
            f"{us:.0f} ({pair})" for pair, us in list(b["idle_us_per_step_by_pair"].items())[:12]))


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--arms", default="v1,v2-sync,v2-async")
    p.add_argument("--sampling", default="greedy", choices=["greedy", "all"],
                   help="greedy, or every sampler feature on every request (temperature, top-k/p, min-p, "
                        "penalties, logit bias, min_tokens, 20 logprobs)")
    p.add_argument("--capture-step", type=int, default=100,
                   help="which full-concurrency decode step to replay for its device time")
    p.add_argument("--step-timeline", action="store_true",
                   help="v2: also trace one replayed decode step and report its device events, idle gaps "
                        "and kernel families (into the JSON; a summary is printed)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG: output tok/s per arm, and steady-decode step wall vs device time")
    add_engine_args(p)
    args = p.parse_args(argv)
    from mrv2_jax.models.loader import load_model
    from mrv2_jax.xla_flags import prefer_vmm_allocator

    # The engines' allocator, asked for here: loading the shared weights starts JAX's backend.
    prefer_vmm_allocator(args.tensor_parallel_size * args.pipeline_parallel_size)
    t0 = time.perf_counter()
    loaded = load_model(args.model, args.dtype, args.load_format, args.seed)
    load_s = time.perf_counter() - t0
    prompts = random_prompts(args.num_prompts, args.input_len, 0.0, loaded[0].vocab_size, 0)
    results = []
    for name in args.arms.split(","):
        results.append(run_arm(name, args, loaded, prompts))
        gc.collect()  # free this arm's KV cache before the next arm sizes its own
        print(json.dumps(results[-1], default=str), flush=True)
    base = next((r for r in results if r["arm"] == "v1"), results[0])
    print(f"\ninput {args.input_len} / output {args.output_len}, {args.num_prompts} prompts, "
          f"max_num_seqs {args.max_num_seqs}, weights loaded in {load_s:.1f} s")
    print(f"{'arm':10} {'out tok/s':>10} {'total tok/s':>12} {'vs v1':>6} {'step wall ms':>13} "
          f"{'step dev ms':>12} {'host ahead':>11} {'enqueue ms':>11} {'GPU busy':>9} {'startup s':>10}")
    fmt = lambda v, f: format(v, f) if v is not None else "-"
    for r in results:
        print(f"{r['arm']:10} {r['output_tokens_per_s']:10.0f} {r['total_tokens_per_s']:12.0f} "
              f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:6.2f} {fmt(r['steady_step_wall_ms'], '13.3f')} "
              f"{fmt(r['steady_step_device_ms'], '12.3f')} {fmt(r.get('steady_step_device_ms_host_ahead'), '11.3f')} "
              f"{fmt(r.get('replay_enqueue_ms'), '11.3f')} "
              f"{fmt(r['gpu_busy_fraction'], '9.1%')} {r['startup_s']:10.1f}")
    for r in results:
        if r.get("step_timeline"):
            print_step_timeline(r["arm"], r["step_timeline"])
    report = {**describe_environment(), "load_s": load_s, "settings": vars(args), "arms": results}
    if args.output_json:
        write_report(report, args.output_json)
    if args.plot:
        from mrv2_jax.bench.plot import plot_ab  # matplotlib only when plotting

        plot_ab(report, args.plot)
        print(f"wrote {args.plot}")
    return report


if __name__ == "__main__":
    main()
