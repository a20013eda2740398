"""Speculative decoding: output tok/s and TPOT with spec on vs off, v2-async vs v1.

    python -m mrv2_jax.bench.spec_decode --output-json spec.json            # both suites
    python -m mrv2_jax.bench.spec_decode --suites demo --num-prompts 64

Suites:
  demo        the embedded demo pair: target checkpoints/demo-qwen3, draft demo-qwen3-draft
              (method draft_model: real acceptance, greedy);
  qwen3-0.6b  the Qwen3-0.6B preset with dummy weights, method synthetic at each
              --acceptance-rates (the drafts cost nothing, each is accepted with that
              probability): the runner machinery at a fixed acceptance.
Every (runner, spec) arm is its own engine over one set of loaded weights; TPOT is per request,
(finished - first token) / (outputs - 1), averaged. The question it answers: with equal
acceptance, how much lower is v2-async's TPOT than v1's (the analogue of vLLM MRV2's GLM-4.7
MTP=1 TPOT -6.3%).
"""

import argparse
import gc
import json
import statistics
import time

from mrv2_jax.bench.dataset import random_prompts
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.models.loader import CHECKPOINTS_DIR

RUNNERS = {"v1": ("v1", False), "v2-async": ("v2", True), "v2-sync": ("v2", False)}


def suite_arms(suite: str, args) -> tuple[str, str, list[tuple[str, dict | None]]]:
    """-> (model, load_format, [(spec label, speculative_config or None)])."""
    k = args.num_speculative_tokens
    if suite == "demo":
        draft = {"method": "draft_model", "num_speculative_tokens": k,
                 "model": str(CHECKPOINTS_DIR / "demo-qwen3-draft")}
        return "demo", "auto", [("off", None), (f"draft k={k}", draft)]
    if suite == "qwen3-0.6b":
        arms = [("off", None)]
        for rate in args.acceptance_rates:
            arms.append((f"synthetic {rate} k={k}",
                         {"method": "synthetic", "num_speculative_tokens": k, "acceptance_rate": rate}))
        return "qwen3-0.6b", "dummy", arms
    raise ValueError(f"unknown suite {suite!r}; known: demo, qwen3-0.6b")


def run_arm(loaded, runner: str, spec, prompts, args) -> dict:
    from mrv2_jax.llm import LLM
    from mrv2_jax.sampling_params import SamplingParams

    kind, async_scheduling = RUNNERS[runner]
    t0 = time.perf_counter()
    # max_fused_steps=1 in every arm: the spec-off baseline is plain one-step decode, so the
    # difference is speculation alone (fused decode, off with spec anyway, is `bench fused`).
    llm = LLM(loaded_model=loaded, runner=kind, async_scheduling=async_scheduling, speculative_config=spec,
              max_fused_steps=1, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.input_len + args.output_len + 16, block_size=16, show_progress=False,
              enable_prefix_caching=False)
    startup = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[: args.max_num_seqs], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    stats_before = llm.engine.scheduler.get_stats().spec_decode
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
             for o in outs if len(o.outputs[0].token_ids) > 1]
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"runner": runner, "elapsed_s": elapsed, "startup_s": startup, "output_tokens_per_s": num_out / elapsed,
              "mean_tpot_ms": 1e3 * statistics.mean(tpots), "median_tpot_ms": 1e3 * statistics.median(tpots),
              "num_output_tokens": num_out}
    stats = llm.engine.scheduler.get_stats().spec_decode
    if stats is not None:  # this run's share only (the warm-up's drafts are subtracted)
        accepted = stats.num_accepted_tokens - stats_before.num_accepted_tokens
        drafted = stats.num_draft_tokens - stats_before.num_draft_tokens
        rows = stats.num_drafts - stats_before.num_drafts
        per_pos = [(a - b) / rows for a, b in zip(stats.accepted_per_position, stats_before.accepted_per_position)]
        result |= {"acceptance_rate": accepted / drafted if drafted else 0.0,
                   "mean_acceptance_length": 1 + accepted / rows if rows else 0.0, "per_position_acceptance": per_pos}
    del llm
    gc.collect()  # free this arm's KV cache before the next arm sizes its own
    return result


def print_table(results: list[dict]) -> None:
    print(f"\n{'suite':11} {'spec':22} {'runner':9} {'out tok/s':>10} {'TPOT ms':>8} {'accept':>7} {'acc len':>8}")
    for r in results:
        acc = f"{r['acceptance_rate']:7.1%}" if "acceptance_rate" in r else f"{'-':>7}"
        length = f"{r['mean_acceptance_length']:8.2f}" if "mean_acceptance_length" in r else f"{'-':>8}"
        print(f"{r['suite']:11} {r['spec']:22} {r['runner']:9} {r['output_tokens_per_s']:10.0f} "
              f"{r['mean_tpot_ms']:8.3f} {acc} {length}")
    print("\nTPOT of v2-async vs v1 at equal spec settings (negative = v2-async faster):")
    for r in results:
        if r["runner"] != "v2-async":
            continue
        v1 = next((x for x in results if x["suite"] == r["suite"] and x["spec"] == r["spec"] and x["runner"] == "v1"),
                  None)
        if v1:
            print(f"  {r['suite']:11} {r['spec']:22} {100 * (r['mean_tpot_ms'] / v1['mean_tpot_ms'] - 1):+6.1f}%")


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", default="demo,qwen3-0.6b")
    p.add_argument("--runners", default="v1,v2-async", help=f"comma-separated, of {', '.join(RUNNERS)}")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=3)
    p.add_argument("--acceptance-rates", default="0.6,0.8", type=lambda s: [float(x) for x in s.split(",")])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32, help="concurrency")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from mrv2_jax.models.loader import load_model
    from mrv2_jax.xla_flags import prefer_vmm_allocator

    prefer_vmm_allocator(1)  # the engines' allocator, asked for before loading weights starts JAX's backend
    results = []
    for suite in args.suites.split(","):
        model, load_format, arms = suite_arms(suite, args)
        loaded = load_model(model, args.dtype, load_format)
        prompts = random_prompts(args.num_prompts, args.input_len, 0.0, loaded[0].vocab_size, 0)
        for label, spec in arms:
            for runner in args.runners.split(","):
                result = {"suite": suite, "spec": label, **run_arm(loaded, runner, spec, prompts, args)}
                results.append(result)
                print(json.dumps(result, default=str), flush=True)
        del loaded
        gc.collect()
    print_table(results)
    report = {**describe_environment(), "settings": vars(args), "results": results}
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
