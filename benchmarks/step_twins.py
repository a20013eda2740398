"""Whether two loaded copies of each step program, called in turn, make the engine's decode calls cheaper.

    python -m benchmarks.step_twins --model qwen3-0.6b --load-format dummy --rows 1 --max-model-len 2048

XLA records a program's command buffer again when an allocation it uses moved since its last call; the
step's result is a new buffer every call while the last call's result is still alive, so it moves every
call. With two loaded copies of a program used in turn, each copy's result can land where its own last one
was (`benchmarks.dispatch_cost`'s `device twins` arm measures the call alone that way). This says whether
it holds in the engine's loop: --rows requests decode at one step per call, and for --rounds rounds the
arms run in turn, --steps measured steps each after --warm-steps unmeasured ones:

  plain   the engine as it is
  twins   every program's calls alternate between it and its twin, made at its first call (the engine's
          `--step-twins`, runner/step_twins.py; GPUs only: XLA:CPU cannot serialize the step programs)

Per arm: the median and P90 host time in the step's compiled call (Runner.call_seconds per step), the
median wall time per step, and the steps with new KV blocks apart (their packed input is fresh, the
others may pass a repeated one from the device).
"""

import argparse
import statistics
import time

from benchmarks.dispatch_cost import one_step_engine
from mrv2_jax.bench.dataset import random_prompts
from mrv2_jax.bench.environment import flag_probe_report
from mrv2_jax.entrypoints.cli import add_engine_args
from mrv2_jax.runner.step_twins import StepTwins


def run_steps(llm, steps: int) -> dict:
    """`steps` engine steps -> per step: host ms in the compiled call, wall ms, whether KV blocks were added."""
    runner, calls, walls, new_blocks = llm.engine.runner, [], [], []
    for _ in range(steps):
        before_call, blocks = runner.call_seconds, llm.engine.scheduler.kv_cache_manager.num_free_blocks
        start = time.perf_counter()
        llm.step()
        walls.append(1e3 * (time.perf_counter() - start))
        calls.append(1e3 * (runner.call_seconds - before_call))
        new_blocks.append(llm.engine.scheduler.kv_cache_manager.num_free_blocks < blocks)
    return {"call_ms": calls, "wall_ms": walls, "new_blocks": new_blocks}


def summary(steps: dict) -> dict:
    calls = steps["call_ms"]
    fresh = [c for c, b in zip(calls, steps["new_blocks"]) if b]
    repeated = [c for c, b in zip(calls, steps["new_blocks"]) if not b]
    return {"steps": len(calls), "call_ms": statistics.median(calls),
            "call_p90_ms": sorted(calls)[int(0.9 * (len(calls) - 1))], "wall_ms": statistics.median(steps["wall_ms"]),
            "call_ms_new_blocks": statistics.median(fresh) if fresh else None, "steps_new_blocks": len(fresh),
            "call_ms_no_new_block": statistics.median(repeated) if repeated else None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warm-steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--arms", default="plain,twins", help="comma-separated, run in this order each round")
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    args = p.parse_args(argv)
    from mrv2_jax.sampling_params import SamplingParams

    llm = one_step_engine(args)
    arms = tuple(args.arms.split(","))
    if unknown := set(arms) - {"plain", "twins"}:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}: plain, twins")
    total = args.rounds * len(arms) * (args.warm_steps + args.steps) + args.warm_steps
    if args.input_len + total + 1 > llm.config.max_model_len:
        raise SystemExit(f"{total} steps after a {args.input_len}-token prompt need --max-model-len > "
                         f"{args.input_len + total}")
    params = SamplingParams(max_tokens=total + 1, ignore_eos=True)
    for prompt in random_prompts(args.rows, args.input_len, 0.0, llm.model_state.vocab_size, 0):
        llm.add_request(prompt, params)
    runner, twins = llm.engine.runner, StepTwins()
    run_steps(llm, args.warm_steps)  # the prompts' prefill and the first decode steps
    measured = {arm: {"call_ms": [], "wall_ms": [], "new_blocks": []} for arm in arms}
    for _ in range(args.rounds):
        for arm in arms:
            runner.step_twins = twins if arm == "twins" else None
            run_steps(llm, args.warm_steps)
            for key, values in run_steps(llm, args.steps).items():
                measured[arm][key] += values
    results = {arm: summary(steps) for arm, steps in measured.items()}
    results["twins_made"] = len(twins)
    print(f"rows {args.rows}, {args.rounds} rounds of {args.steps} steps per arm, {len(twins)} programs twinned")
    print(f"{'arm':6} {'call ms':>8} {'call p90':>9} {'wall ms':>8} {'call, new blocks':>17} {'call, none':>11}")
    for arm in arms:
        r = results[arm]
        print(f"{arm:6} {r['call_ms']:8.3f} {r['call_p90_ms']:9.3f} {r['wall_ms']:8.3f} "
              f"{r['call_ms_new_blocks'] or 0:17.3f} {r['call_ms_no_new_block'] or 0:11.3f}")
    return flag_probe_report(args, results, args.output_json)


if __name__ == "__main__":
    main()
