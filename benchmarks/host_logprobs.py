"""Microbenchmark: the host cost of sample logprobs per engine step, on the CPU, without a model.

    python -m benchmarks.host_logprobs
    python -m benchmarks.host_logprobs --num-rows 256 --num-logprobs 20 --steps 128 --tokenizer none

Each step is what the engine does on the host after a decode step: `PendingStep.logprobs()` on
fake host arrays of a SamplerOutput, the engine core's attach (`entries[: len(new_token_ids)]`),
then `OutputProcessor.process`. Cases: streaming (a snapshot per token, the server's path) and
final_only (`LLM.generate`), each with and without logprobs, so the logprob part is the difference.
Per-step times are the median over the steps of one run; the requests grow by one token a step, so
a per-request cost that grows with the output length shows up in the median too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.host_fakes import DEMO_TOKENIZER, HostArray, load_tokenizer_arg
from mrv2_jax.engine.output_processor import OutputProcessor
from mrv2_jax.engine.request import Request
from mrv2_jax.engine.scheduler_output import EngineCoreOutput
from mrv2_jax.runner.v2 import PendingStep
from mrv2_jax.sample.sampler import SamplerOutput
from mrv2_jax.sampling_params import SamplingParams


def _fake_step(rng, num_rows: int, width: int, vocab: int) -> SamplerOutput:
    host = lambda a: a.view(HostArray)  # noqa: E731
    return SamplerOutput(tokens=host(rng.integers(0, vocab, num_rows, dtype=np.int32)),
                         logprobs=host(-rng.random((num_rows, width), dtype=np.float32) * 10),
                         logprob_token_ids=host(rng.integers(0, vocab, (num_rows, width), dtype=np.int32)),
                         sampled_rank=host(rng.integers(1, 50, num_rows, dtype=np.int32)))


def run_case(tokenizer, *, num_rows: int, num_logprobs: int | None, steps: int, final_only: bool,
             vocab: int, seed: int = 0) -> dict:
    """-> median µs per step of `PendingStep.logprobs` (+ attach) and of `OutputProcessor.process`."""
    rng = np.random.default_rng(seed)
    width = 1 + (num_logprobs or 0)
    processor = OutputProcessor(tokenizer)
    req_ids = [f"r{i}" for i in range(num_rows)]
    params = SamplingParams(max_tokens=steps + 1, logprobs=num_logprobs, ignore_eos=True)
    for r in req_ids:
        processor.add(Request(r, [1, 2, 3, 4], params), final_only=final_only)
    wants = {r: num_logprobs for r in req_ids} if num_logprobs is not None else {}
    steps_data = [_fake_step(rng, num_rows, width, vocab) for _ in range(steps)]
    logprob_us, process_us = [], []
    for out in steps_data:
        t0 = time.perf_counter()
        pending = PendingStep(out, req_ids, set(req_ids), wants)
        tokens = pending.result()
        logprobs = pending.logprobs()
        core = [EngineCoreOutput(r, tokens[r]) for r in req_ids]
        for c in core:  # what EngineCore._update does
            entries = logprobs.get(c.req_id)
            c.new_logprobs = None if entries is None else entries[: len(c.new_token_ids)]
        t1 = time.perf_counter()
        processor.process(core)
        t2 = time.perf_counter()
        logprob_us.append((t1 - t0) * 1e6)
        process_us.append((t2 - t1) * 1e6)
    return {"runner_us": statistics.median(logprob_us), "process_us": statistics.median(process_us)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-rows", type=int, default=256)
    ap.add_argument("--num-logprobs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--tokenizer", default=str(DEMO_TOKENIZER), help="a tokenizer directory, or 'none'")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer_arg(args.tokenizer)
    if tokenizer is not None:
        args.vocab = min(args.vocab, len(tokenizer))
    print(f"{args.num_rows} rows, logprobs={args.num_logprobs}, {args.steps} steps, "
          f"tokenizer={'none' if tokenizer is None else args.tokenizer}")
    for final_only in (False, True):
        for n in (None, args.num_logprobs):
            r = run_case(tokenizer, num_rows=args.num_rows, num_logprobs=n, steps=args.steps,
                         final_only=final_only, vocab=args.vocab)
            name = f"{'final_only' if final_only else 'streaming'} logprobs={n}"
            print(f"  {name:28s} runner+attach {r['runner_us']:8.0f} µs/step   "
                  f"process {r['process_us']:8.0f} µs/step   total {r['runner_us'] + r['process_us']:8.0f}")


if __name__ == "__main__":
    main()
