"""Offline throughput, in the manner of `vllm bench throughput` (random dataset).

    python -m mrv2_jax.bench.throughput --model qwen3-0.6b --load-format dummy \
        --input-len 128 --output-len 128 --num-prompts 1000 --runner v1 --output-json out.json

`--structured-outputs '{"regex": "[a-z ]*"}'` gives every timed request that constraint (a preset
needs `--tokenizer`); EOS is then not ignored, so outputs may end before --output-len.
"""

import argparse
import json
import time

from mrv2_jax.bench.dataset import random_prompts
from mrv2_jax.bench.environment import describe_environment, write_report
from mrv2_jax.bench.structured_check import count_valid
from mrv2_jax.entrypoints.cli import add_engine_args, engine_kwargs


def run(args) -> dict:
    from mrv2_jax.llm import LLM
    from mrv2_jax.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    llm.wait_for_compiles()  # no compile beside the timed steps
    startup = time.perf_counter() - t0
    prompts = random_prompts(args.num_prompts, args.input_len, args.random_range_ratio,
                             llm.model_state.vocab_size, args.dataset_seed, args.random_prefix_len)
    constraint = json.loads(args.structured_outputs) if args.structured_outputs else None
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=constraint is None,
                            structured_outputs=constraint)
    if args.warmup_prompts:
        # Prompts of their own (another seed): reusing the timed ones would turn the run's
        # prefills into prefix-cache hits.
        warm = random_prompts(args.warmup_prompts, args.input_len, 0.0, llm.model_state.vocab_size,
                              args.dataset_seed + 1)
        # With a constraint they carry it too: its one-time compile (once per distinct constraint
        # in a server) is then not inside the timed run, as vLLM's arm does for its grammar.
        llm.generate(warm, SamplingParams(max_tokens=min(args.output_len, 16), ignore_eos=constraint is None,
                                          structured_outputs=constraint), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    num_in = sum(len(p) for p in prompts)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    config = llm.config
    validity = (count_valid([(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], constraint)
                if constraint else None)
    return {
        **describe_environment(), "elapsed_s": elapsed, "startup_s": startup,
        "startup_split": llm.engine.startup.as_dict(),
        "requests_per_s": len(prompts) / elapsed, "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed, "num_prompts": len(prompts),
        "input_len": args.input_len, "random_prefix_len": args.random_prefix_len,
        "output_len": args.output_len, "num_input_tokens": num_in, "structured_outputs": constraint,
        "structured_validity": validity,
        "num_output_tokens": num_out, "runner": config.runner,
        "async_scheduling": llm.engine.async_scheduling,
        # Runner calls that decoded several steps at once (fused decode), warm-up included.
        "num_fused_calls": getattr(llm.engine.runner, "num_fused_calls", 0),
        "settings": {k: v for k, v in vars(config).items()},
    }


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="a random prefix of this many tokens shared by every prompt, before its own "
                        "--input-len tokens (prefix caching can reuse it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--warmup-prompts", type=int, default=0,
                   help="untimed prompts (of their own, 16 output tokens each, with --structured-outputs' "
                        "constraint) before the run")
    p.add_argument("--structured-outputs", default=None,
                   help="a JSON object of StructuredOutputsParams fields given to every timed request")
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    args = p.parse_args(argv)
    result = run(args)
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, "
          f"{result['total_tokens_per_s']:.2f} total tokens/s, "
          f"{result['output_tokens_per_s']:.2f} output tokens/s "
          f"(runner {result['runner']}, async {result['async_scheduling']}, startup {result['startup_s']:.1f} s, "
          f"{result['num_fused_calls']} fused calls)")
    if result["structured_validity"]:
        print(f"Structured outputs: {result['structured_validity']}")
    if args.output_json:
        write_report(result, args.output_json)
    return result


if __name__ == "__main__":
    main()
