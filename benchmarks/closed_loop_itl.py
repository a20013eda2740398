"""Probe: streams under a closed-loop client, offline (no HTTP, no API process): which steps set
the P99 inter-token gap.

    python -m benchmarks.closed_loop_itl --model qwen3-0.6b --load-format dummy \
        --concurrency 1 32 128 256 --prompts-per-stream 3 --output-json itl.json

Each of C streams sends its next request when its last one has finished, as `bench serve`'s client
does at a fixed concurrency; the requests are streaming ones (fused decode capped by the stream
interval, as in the server) and go through `LLM.add_request` and `LLM.step`. A token arrives when
`step()` returns the output that brings it. Per request, as the serving client counts them: TPOT
is (last arrival - first) / (tokens - 1), and there is one gap per output after the first. Each
engine step's interval and shape come from a step log, so every gap is put in one of two kinds:
it spans a step that scheduled prompt tokens (a step with more tokens than rows), or it spans
decode steps only. The split says whether the P99 gap is the cost of the steps that admit new
prompts (docs/benchmarks.md, session 25).
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import time

import numpy as np

from mrv2_jax.bench.dataset import random_prompts
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.bench.step_log import StepLog, attach_hooks
from mrv2_jax.entrypoints.cli import add_engine_args, engine_kwargs


def drive(llm, prompts: list[list[int]], params, concurrency: int) -> tuple[dict, list[list[int]]]:
    """Run `prompts` as `concurrency` closed-loop streams. -> ({request id: [(arrival s, tokens so
    far)]}, each prompt's output token ids)."""
    queue = list(enumerate(prompts))[::-1]
    arrivals: dict[str, list[tuple[float, int]]] = {}
    index_of: dict[str, int] = {}
    finals: list[list[int]] = [[] for _ in prompts]

    def send():
        i, prompt = queue.pop()
        request_id = llm.add_request(prompt, params, streaming=True)
        arrivals[request_id], index_of[request_id] = [], i

    for _ in range(min(concurrency, len(queue))):
        send()
    running = len(arrivals)
    while running:
        outputs = llm.step()
        now = time.perf_counter()
        for out in outputs:
            arrivals[out.request_id].append((now, len(out.outputs[0].token_ids)))
            if out.finished:
                finals[index_of[out.request_id]] = list(out.outputs[0].token_ids)
                running -= 1
                if queue:
                    send()
                    running += 1
        if running and not llm.engine.has_work():
            raise RuntimeError(f"the engine went idle with {running} request(s) unfinished")
    return arrivals, finals


def classify_gaps(arrivals, steps) -> dict:
    """Per-request TPOT and gaps; each gap marked by whether a step that scheduled prompt tokens
    ran inside it. `steps`: (start, end, num_tokens, num_reqs) per engine step, sorted by start; a
    step with more tokens than rows admitted prompt tokens (one step per call: streaming requests
    with the default stream interval, no speculative decoding).
    With async scheduling a call returns the outputs of the step before it, so the step that
    started last before the gap counts too."""
    starts = [s[0] for s in steps]
    admits = np.cumsum([0] + [int(tokens > rows) for _, _, tokens, rows in steps])
    tpots, admit_gaps, decode_gaps = [], [], []
    for points in arrivals.values():
        times = [t for t, _ in points]
        if points and points[-1][1] > 1:
            tpots.append((times[-1] - times[0]) / (points[-1][1] - 1))
        for prev, cur in zip(times, times[1:]):
            lo, hi = max(0, bisect.bisect_left(starts, prev) - 1), bisect.bisect_left(starts, cur)
            (admit_gaps if admits[hi] > admits[lo] else decode_gaps).append(cur - prev)
    return {"tpots": tpots, "admit_gaps": admit_gaps, "decode_gaps": decode_gaps}


def after_step_periods(steps) -> tuple[list[float], list[float]]:
    """The period (start to next start) of each call after a step that admitted prompt tokens, and
    of each call after a decode-only step: with async scheduling, the call that waits on that step."""
    admit, decode = [], []
    for before, (start, *_), (next_start, *_) in zip(steps, steps[1:], steps[2:]):
        (admit if before[2] > before[3] else decode).append(next_start - start)
    return admit, decode


def summarize(classified: dict, steps, elapsed: float, num_tokens: int) -> dict:
    def ms(xs, q):
        return round(1e3 * float(np.percentile(xs, q)), 3) if xs else None

    gaps = classified["admit_gaps"] + classified["decode_gaps"]
    tpot = 1e3 * statistics.mean(classified["tpots"]) if classified["tpots"] else None
    p99 = ms(gaps, 99)
    after_admit, after_decode = after_step_periods(steps)
    return {"output_tokens_per_s": num_tokens / elapsed, "mean_tpot_ms": tpot and round(tpot, 3),
            "mean_itl_ms": round(1e3 * statistics.mean(gaps), 3) if gaps else None, "p99_itl_ms": p99,
            "p99_itl_over_tpot": round(p99 / tpot, 3) if (p99 and tpot) else None,
            "num_gaps": len(gaps), "admit_gap_share": len(classified["admit_gaps"]) / max(1, len(gaps)),
            "admit_gap_p50_ms": ms(classified["admit_gaps"], 50), "admit_gap_p99_ms": ms(classified["admit_gaps"], 99),
            "decode_gap_p50_ms": ms(classified["decode_gaps"], 50),
            "decode_gap_p99_ms": ms(classified["decode_gaps"], 99),
            "num_steps": len(steps), "num_admit_steps": sum(tokens > rows for _, _, tokens, rows in steps),
            "after_admit_period_p50_ms": ms(after_admit, 50), "after_decode_period_p50_ms": ms(after_decode, 50),
            "after_decode_period_p99_ms": ms(after_decode, 99)}


def run(args) -> dict:
    from mrv2_jax.llm import LLM
    from mrv2_jax.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs(args))
    llm.wait_for_compiles()
    vocab = llm.model_state.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warm = random_prompts(max(args.concurrency), args.input_len, 0.0, vocab, args.dataset_seed + 1)
    llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    levels = []
    for c in args.concurrency:
        prompts = random_prompts(c * args.prompts_per_stream, args.input_len, 0.0, vocab, args.dataset_seed + c)
        log = StepLog()
        attach_hooks(llm.engine, log)
        t0 = time.perf_counter()
        arrivals, _ = drive(llm, prompts, params, c)
        elapsed = time.perf_counter() - t0
        attach_hooks(llm.engine, None)
        steps = sorted(log.steps)
        num_tokens = sum(points[-1][1] for points in arrivals.values() if points)
        level = {"concurrency": c, "requests": len(prompts)}
        level |= summarize(classify_gaps(arrivals, steps), steps, elapsed, num_tokens)
        levels.append(level)
        print(f"C={c:4d}: {level['output_tokens_per_s']:8.0f} out tok/s, TPOT {level['mean_tpot_ms']} ms, "
              f"P99 ITL {level['p99_itl_ms']} ms ({level['p99_itl_over_tpot']}x), gaps spanning an admitting "
              f"step {100 * level['admit_gap_share']:.1f}% (P50 {level['admit_gap_p50_ms']}, P99 "
              f"{level['admit_gap_p99_ms']} ms), decode-only gaps P50 {level['decode_gap_p50_ms']} / P99 "
              f"{level['decode_gap_p99_ms']} ms; steps {level['num_steps']} ({level['num_admit_steps']} admitting), "
              f"call period after an admitting step P50 {level['after_admit_period_p50_ms']} ms, after a decode "
              f"step P50 {level['after_decode_period_p50_ms']} / P99 {level['after_decode_period_p99_ms']} ms",
              flush=True)
    return {**describe_environment(), "input_len": args.input_len, "output_len": args.output_len,
            "prompts_per_stream": args.prompts_per_stream, "settings": vars(llm.config), "levels": levels}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument("--prompts-per-stream", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    args = p.parse_args(argv)
    report = run(args)
    write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
