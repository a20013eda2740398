"""Small-batch decode latency: fused decode (K decode steps per dispatch) against one step per
dispatch, at a few fixed batch sizes.

    mrv2-jax bench fused --model qwen3-0.6b --load-format dummy \
        --batches 1 8 32 --input-len 128 --output-len 512 --output-json fused.json

Weights are loaded once; each `--fused-steps` value gets its own engine (K = 1: fused decode
off; K > 1: the scheduler's adaptive K, up to that many steps per call); `--in-call` adds, for each
K > 1, an engine that streams each step's tokens from inside its fused calls (`--stream-in-call`:
the requests are streams, and a token arrives when its step's callback hands it over). Per batch size B, B
requests of `--input-len` random tokens each generate `--output-len` tokens (greedy, EOS
ignored), all submitted at once, streamed. Reported per (K, B):
  output tok/s         all output tokens / wall time from submission to the last token
  ms/token             median over requests of (last token - first token) / (tokens - 1):
                       the steady decode latency one request sees
  TTFT ms              median time to first token
  max gap ms           median over requests of the longest wait between two deliveries
                       (fused calls deliver K tokens at once: the streaming burstiness)
  deliveries/token     distinct arrival times per token (1: token by token; 1/K: K at once)
  dispatches/token     engine steps per output token of one request
  device ms/token      one steady decode dispatch (the middle one) replayed alone on a copy of
                       its state, divided by its steps: the device floor of this engine
  busy                 device ms/token / ms/token: how much of the wall time the GPU works
"""

import argparse
import gc
import itertools
import statistics
import time

from mrv2_jax import envs
from mrv2_jax.bench.capture import DecodeStepCapture, replay
from mrv2_jax.bench.dataset import random_prompts
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.bench.step_log import attach_hooks
from mrv2_jax.entrypoints.cli import add_engine_args, engine_kwargs

# vLLM 0.22.1 on the same H200 (shared/DESIGN.md): batch 1, input 128 / output 512.
VLLM_BATCH1 = {"vllm_mrv2_output_tokens_per_s": 441, "vllm_v1_output_tokens_per_s": 455}


def run_requests(llm, prompts, params, in_call: bool) -> dict[str, list[float]]:
    """Run `prompts` to the end -> each request's token arrival times: when the engine first hands
    a token over (a step's outputs, all of that step's tokens at once; with `in_call`, the requests
    are streams and a fused step's tokens arrive with its callback)."""
    seen: dict[str, dict[int, float]] = {}

    def sink(entries):
        now = time.perf_counter()
        for req_id, index, _ in entries:
            seen.setdefault(req_id, {}).setdefault(index, now)

    if in_call:
        llm.engine.attach_token_sink(sink)
    try:
        pending = {llm.add_request(p, params, streaming=in_call) for p in prompts}
        while pending:
            outputs, now = llm.step(), time.perf_counter()
            for out in outputs:
                got = seen.setdefault(out.request_id, {})
                for index in range(len(out.outputs[0].token_ids)):
                    got.setdefault(index, now)
                if out.finished:
                    pending.discard(out.request_id)
    finally:
        if in_call:
            llm.engine.attach_token_sink(None)
    return {req_id: [times[i] for i in sorted(times)] for req_id, times in seen.items()}


def measure(llm, prompts, output_len: int, fused_steps: int) -> dict:
    from mrv2_jax.sampling_params import SamplingParams

    engine = llm.engine
    in_call = engine.runner.stream_in_call
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    steps = min(fused_steps, output_len - 1)
    # The dispatch that decodes around the middle of the outputs: every row of the batch decoding,
    # `steps` steps each (1: an ordinary step), replayed alone afterwards for its device time.
    capture = DecodeStepCapture(engine.runner, len(prompts), max(1, output_len // 2 // max(steps, 1)), steps)
    fused_before = getattr(engine.runner, "num_fused_calls", 0)
    attach_hooks(engine, capture)
    start = time.perf_counter()
    arrivals = run_requests(llm, prompts, params, in_call)
    elapsed = time.perf_counter() - start
    attach_hooks(engine, None)
    num_steps = len(capture.steps)
    device_ms = None
    if capture.captured:  # (this moves the runner's state: after the measured run)
        capture.restore_state()
        device_ms = replay(capture.dispatch, 5)[0] * 1e3 / steps
    itl = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in arrivals.values()]
    gaps = [max(b - a for a, b in itertools.pairwise(t)) * 1e3 for t in arrivals.values()]
    ms_per_token = statistics.median(itl)
    return {
        "batch": len(prompts), "max_fused_steps": fused_steps, "stream_in_call": in_call, "elapsed_s": elapsed,
        "output_tokens_per_s": len(prompts) * output_len / elapsed,
        "ms_per_token": ms_per_token,
        "ttft_ms": statistics.median((t[0] - start) * 1e3 for t in arrivals.values()),
        "max_gap_ms": statistics.median(gaps),
        "deliveries_per_token": statistics.mean(len(set(t)) / len(t) for t in arrivals.values()),
        "engine_steps": num_steps, "fused_calls": getattr(engine.runner, "num_fused_calls", 0) - fused_before,
        "dispatches_per_token": num_steps / output_len,
        "device_ms_per_token": device_ms,
        "gpu_busy": None if device_ms is None else device_ms / ms_per_token,
    }


def run(args) -> dict:
    from mrv2_jax.engine import compilation_cache
    from mrv2_jax.llm import LLM
    from mrv2_jax.models.loader import load_model
    from mrv2_jax.sampling_params import SamplingParams
    from mrv2_jax.xla_flags import prefer_vmm_allocator

    # The engines' allocator, asked for before the cache's settings and the shared weights start JAX's backend.
    prefer_vmm_allocator(args.tensor_parallel_size * args.pipeline_parallel_size)
    compilation_cache.enable()
    t0 = time.perf_counter()
    loaded = load_model(args.model, args.dtype, args.load_format, args.seed)
    load_s = time.perf_counter() - t0
    vocab = loaded[0].vocab_size
    kwargs = engine_kwargs(args)
    kwargs["max_num_seqs"] = args.max_num_seqs or max(args.batches)
    results = []
    arms = [(k, False) for k in args.fused_steps] + [(k, True) for k in args.fused_steps if args.in_call and k > 1]
    for k, in_call in arms:
        t0 = time.perf_counter()
        llm = LLM(loaded_model=loaded, **(kwargs | {"max_fused_steps": k, "show_progress": False,
                                                    "stream_in_call": in_call}))
        llm.wait_for_compiles()
        startup_s = time.perf_counter() - t0
        # Warm-up: every batch size once, short, on prompts the measured runs do not share.
        warm = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        for b in args.batches:
            llm.generate(random_prompts(b, args.input_len, 0.0, vocab, seed=1000 + b), warm, use_tqdm=False)
        for b in args.batches:
            prompts = random_prompts(b, args.input_len, 0.0, vocab, seed=b)
            row = measure(llm, prompts, args.output_len, k)
            row["startup_s"] = startup_s
            results.append(row)
            print(f"  K={k:<3}{' in-call' if in_call else ''} batch {b:<4} {row['output_tokens_per_s']:9.0f} tok/s "
                  f"{row['ms_per_token']:7.3f} ms/token", flush=True)
        del llm
        gc.collect()  # the engine holds reference cycles: free its KV cache before the next sizes its own
    return {**describe_environment(), "load_s": load_s, "input_len": args.input_len,
            "output_len": args.output_len, "xla_flags": envs.get_xla_flags(), "settings": kwargs,
            "reference": VLLM_BATCH1, "results": results}


def print_table(report: dict) -> None:
    print(f"\ninput {report['input_len']} / output {report['output_len']}, {report['device']}, "
          f"jax {report['jax_version']}, git {report['git_sha']}, XLA_FLAGS={report['xla_flags'] or '-'}")
    print(f"{'batch':>5} {'K':>8} {'out tok/s':>10} {'ms/token':>9} {'TTFT ms':>8} {'max gap ms':>10} "
          f"{'disp/token':>10} {'dev ms/token':>12} {'busy':>5}")

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for r in sorted(report["results"], key=lambda r: (r["batch"], r["max_fused_steps"], r["stream_in_call"])):
        k = f"{r['max_fused_steps']}{' in-call' if r['stream_in_call'] else ''}"
        print(f"{r['batch']:>5} {k:>8} {r['output_tokens_per_s']:>10.0f} {r['ms_per_token']:>9.3f} "
              f"{r['ttft_ms']:>8.1f} {r['max_gap_ms']:>10.2f} {r['dispatches_per_token']:>10.3f} "
              f"{fmt(r['device_ms_per_token'], '>12.3f')} {fmt(r['gpu_busy'], '>5.2f')}")
    ref = report["reference"]
    print(f"vLLM 0.22.1 batch 1 (same GPU, DESIGN.md): MRV2 {ref['vllm_mrv2_output_tokens_per_s']} tok/s, "
          f"V1 {ref['vllm_v1_output_tokens_per_s']} tok/s")


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--fused-steps", type=int, nargs="+", default=[1, 16],
                   help="max_fused_steps of each engine (1: fused decode off)")
    p.add_argument("--in-call", action="store_true",
                   help="also each K > 1 with the tokens streamed from inside the fused calls")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    p.set_defaults(max_num_seqs=None)  # default: the largest batch
    args = p.parse_args(argv)
    report = run(args)
    print_table(report)
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
