"""Microbenchmark: the engine's own host work per decode step, on the CPU, without a model.

    python -m benchmarks.host_step
    python -m benchmarks.host_step --rows 256 1024 --steps 200 --tokenizer none

It measures HOST WORK ONLY. The real Scheduler (with its KV cache manager and prefix cache), the
real EngineCore step loop (async scheduling) and the real OutputProcessor run as `LLM.step` runs
them; the model runner is a stand-in that computes nothing: its `execute` draws one random token
per sampling row and returns it as a `PendingStep` over numpy arrays that are already on the host,
so `result()` is the real token read-out and nothing waits for a device. The runner's own input
packing (`ModelRunnerV2.execute`) and the jitted call are not measured here.

Each step is split as `mrv2-jax bench timeline` splits it (its `StepRecorder` wraps the engine's calls):
schedule, execute (the stand-in: not engine work), result (`PendingStep.result()`), update
(`Scheduler.update_from_output`), core other (the rest of `EngineCore.step`: the logprob attach
and the loop itself) and process (`OutputProcessor.process`). Two cases: final_only (as
`LLM.generate` adds its requests: no output until a request finishes) and streaming (a
`RequestOutput` per request and step, detokenized every step; the requests stream as a server's do,
with fused decode on and a stream interval of 1, so the scheduler decides K = 1 at every step).
Only steady decode steps count (every one of the `rows` requests decoding one token); the median
over them is reported. The requests grow by one token a step, so a cost that grows with the output
length shows too.

`--evict-mb N`: the stand-in's `execute` also writes N MB (as a real step's packing, XLA runtime and
transfers touch memory), so that the engine's next parts start with its objects out of the CPU
caches, as they do beside a real runner; 0 (the default) keeps them cache-hot.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.host_fakes import DEMO_TOKENIZER, HostArray, load_tokenizer_arg
from mrv2_jax.bench.timeline import StepRecorder
from mrv2_jax.config import CacheConfig, SchedulerConfig
from mrv2_jax.engine.engine_core import EngineCore
from mrv2_jax.engine.output_processor import OutputProcessor
from mrv2_jax.engine.request import Request
from mrv2_jax.engine.scheduler import Scheduler
from mrv2_jax.gc_heap import relaxed_collection
from mrv2_jax.runner.step_result import StepResult
from mrv2_jax.runner.v2 import PendingStep
from mrv2_jax.sample.sampler import SamplerOutput
from mrv2_jax.sampling_params import SamplingParams

PARTS = ("schedule", "execute", "result", "update", "core_other", "process")
ENGINE_PARTS = ("schedule", "result", "update", "core_other", "process")  # the engine's own


class StandInRunner:
    """Computes nothing: every sampling row gets a random token, ready on the host."""

    is_async_capable = True
    supports_prompt_logprobs = False
    max_fused_rows = 0
    num_fused_calls = 0
    call_seconds = 0.0  # no compiled calls
    automaton_capacity = (0, 0)  # no structured outputs
    eos_token_ids = ()  # (read for streaming requests; no engine process streams from inside calls here)

    def __init__(self, vocab: int, seed: int = 0, evict_mb: int = 0):
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab
        self._evict = np.zeros(evict_mb << 20, np.uint8) if evict_mb else None

    def execute(self, out):
        req_ids = list(out.num_scheduled_tokens)
        if not req_ids:
            return StepResult({})
        tokens = self._rng.integers(0, self._vocab, len(req_ids), dtype=np.int32).view(HostArray)
        if self._evict is not None:
            self._evict += 1  # every cache line written: the engine's objects leave the caches
        return PendingStep(SamplerOutput(tokens=tokens), req_ids, out.sampling_req_ids, {})


def build(rows: int, prompt_len: int, max_tokens: int, streaming: bool, block_size: int = 16,
          evict_mb: int = 0) -> EngineCore:
    """An async engine over the stand-in runner, with room for every request's whole length; for
    streaming requests, fused decode on as in a server (their stream interval keeps K at 1)."""
    max_model_len = prompt_len + max_tokens
    blocks = rows * -(-max_model_len // block_size) + 1
    fused = dict(max_fused_steps=16, max_fused_rows=rows, stream_interval=1) if streaming else {}
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=max(8192, rows),
                                          max_model_len=max_model_len, **fused),
                          CacheConfig(block_size=block_size, num_gpu_blocks=blocks), eos_token_id=None)
    return EngineCore(scheduler, StandInRunner(vocab=1000, evict_mb=evict_mb), async_scheduling=True)


def run_case(tokenizer, *, rows: int, steps: int, final_only: bool, prompt_len: int = 64,
             seed: int = 0, evict_mb: int = 0) -> dict:
    """-> median µs per steady decode step of each part (PARTS), and their engine total."""
    max_tokens = steps + 8  # nobody finishes inside the measured steps
    engine = build(rows, prompt_len, max_tokens, streaming=not final_only, evict_mb=evict_mb)
    processor = OutputProcessor(tokenizer)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(rows):
        request = Request(f"r{i}", rng.integers(0, 1000, prompt_len).tolist(), params, streaming=not final_only)
        engine.add_request(request)
        processor.add(request, final_only=final_only)
    recorder = StepRecorder(engine, rows, skip=0, window=0, trace_dir=None)
    process_us = []
    with relaxed_collection():  # as LLM.generate runs its steps (mrv2_jax/gc_heap.py)
        while engine.has_work():  # LLM.step
            outputs = engine.step()
            t0 = time.perf_counter()
            _, stopped = processor.process(outputs)
            process_us.append(1e6 * (time.perf_counter() - t0))
            if stopped:
                engine.finish_requests(stopped)
    records = recorder.finish()
    steady = []
    for record, process in zip(records, process_us):
        if record["num_tokens"] == record["num_reqs"] == rows:
            us = {k: 1e3 * record[f"{k}_ms"] for k in ("schedule", "update")}
            us["execute"], us["result"] = 1e3 * record["dispatch_ms"], 1e3 * record["wait_ms"]
            us["core_other"] = 1e3 * record["host_other_ms"]
            us["process"] = process
            steady.append(us)
    # The first steady step still reads the last prefill's tokens; the last ones the finishes.
    steady = steady[1:-1]
    result = {k: statistics.median(s[k] for s in steady) for k in PARTS}
    result["engine_total"] = statistics.median(sum(s[k] for k in ENGINE_PARTS) for s in steady)
    result["num_steps"] = len(steady)
    return result


def main(argv=None, prog=None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokenizer", default=str(DEMO_TOKENIZER), help="a tokenizer directory, or 'none'")
    ap.add_argument("--evict-mb", type=int, default=0,
                    help="MB the stand-in runner writes each step, evicting the engine's objects from the caches")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer_arg(args.tokenizer)
    print(f"{args.steps} steps, prompt {args.prompt_len} tokens, "
          f"tokenizer={'none' if tokenizer is None else args.tokenizer}, caches evicted by {args.evict_mb} MB a step; "
          "median µs per steady decode step")
    print(f"  {'case':22s}" + "".join(f"{k:>11s}" for k in PARTS) + f"{'engine':>11s}")
    cases = []
    for rows in args.rows:
        for final_only in (True, False):
            r = run_case(tokenizer, rows=rows, steps=args.steps, final_only=final_only,
                         prompt_len=args.prompt_len, evict_mb=args.evict_mb)
            name = f"{rows} {'final_only' if final_only else 'streaming'}"
            print(f"  {name:22s}" + "".join(f"{r[k]:11.0f}" for k in PARTS) + f"{r['engine_total']:11.0f}")
            cases.append({"rows": rows, "final_only": final_only, "median_us": r})
    if args.output_json:
        from mrv2_jax.bench.environment import describe_environment, write_report

        write_report({**describe_environment(), "settings": vars(args), "cases": cases}, args.output_json)


if __name__ == "__main__":
    main()
