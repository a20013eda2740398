"""One vLLM arm of `bench compare`: vLLM's offline engine on the same random token prompts as
mrv2-jax's arms (same generator, seed and vocabulary), timed the way `vllm bench throughput`
times it (one `LLM.generate` over every prompt, after the engine is built).

Run by `bench compare` in its own process, with vLLM's environment (PYTHONPATH with vLLM,
VLLM_USE_V2_MODEL_RUNNER=0|1). It imports no JAX: JAX would take GPU memory from vLLM.

    VLLM_USE_V2_MODEL_RUNNER=1 python -m mrv2_jax.bench.vllm_throughput --model /tmp/qwen3-0.6b \
        --input-len 128 --output-len 512 --num-prompts 1000 --max-num-seqs 256 --output-json v.json
"""

import argparse
import json
import time

from mrv2_jax import envs
from mrv2_jax.bench.dataset import random_prompts, vocab_size_of
from mrv2_jax.bench.structured_check import count_valid


def engine_argv(args) -> list[str]:
    """vLLM engine arguments, in vLLM's own command-line spelling (parsed by vLLM's parser, as
    `vllm bench throughput` does, so that every version's names and defaults apply)."""
    argv = ["--model", args.model, "--load-format", args.load_format, "--dtype", args.dtype,
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--seed", str(args.seed), "--block-size", str(args.block_size),
            "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching"]
    if args.attention_backend:
        argv += ["--attention-backend", args.attention_backend]
    return argv + list(args.vllm_arg or [])


def run(args) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    argv = engine_argv(args)
    engine_args = EngineArgs.from_cli_args(parser.parse_args(argv))
    t0 = time.perf_counter()
    # from_engine_args keeps nested configs as objects; dataclasses.asdict would turn them into
    # dicts of Nones that vLLM 0.22.1's pydantic configs reject.
    llm = LLM.from_engine_args(engine_args)
    startup = time.perf_counter() - t0

    vocab = vocab_size_of(args.model)
    prompts = random_prompts(args.num_prompts, args.input_len, 0.0, vocab, args.dataset_seed)
    constraint = json.loads(args.structured_outputs) if args.structured_outputs else None
    structured = {}
    if constraint:  # as in mrv2-jax's arm: EOS ends a complete output, and texts are checked
        from vllm.sampling_params import StructuredOutputsParams

        structured = {"structured_outputs": StructuredOutputsParams(**constraint)}
    params = SamplingParams(n=1, temperature=args.temperature, top_p=1.0, ignore_eos=constraint is None,
                            max_tokens=args.output_len, detokenize=args.detokenize or constraint is not None,
                            **structured)
    if args.warmup_prompts:  # prompts of their own, and the constraint, as in mrv2-jax's throughput bench
        warm = random_prompts(args.warmup_prompts, args.input_len, 0.0, vocab, args.dataset_seed + 1)
        llm.generate([{"prompt_token_ids": p} for p in warm],
                     SamplingParams(max_tokens=min(args.output_len, 16), ignore_eos=constraint is None,
                                    detokenize=constraint is not None, **structured), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    num_in = sum(len(p) for p in prompts)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    validity = (count_valid([(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], constraint)
                if constraint else None)
    return {"engine": "vllm", "vllm_version": vllm.__version__, "torch_version": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "runner": "v2" if envs.read_external("VLLM_USE_V2_MODEL_RUNNER") == "1" else
                      ("v1" if envs.read_external("VLLM_USE_V2_MODEL_RUNNER") == "0" else "default"),
            "engine_argv": argv, "startup_s": startup, "elapsed_s": elapsed, "num_prompts": len(prompts),
            "num_input_tokens": num_in, "num_output_tokens": num_out, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": num_out / elapsed, "total_tokens_per_s": (num_in + num_out) / elapsed,
            "structured_outputs": constraint, "structured_validity": validity}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory (config.json; tokenizer for --detokenize)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--detokenize", action="store_true")
    p.add_argument("--warmup-prompts", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--attention-backend", default="FLASH_ATTN")
    p.add_argument("--vllm-arg", action="append", help="one more vLLM engine argument (repeatable), e.g. "
                   "--vllm-arg=--enforce-eager")
    p.add_argument("--structured-outputs", default=None,
                   help="a JSON object of StructuredOutputsParams fields given to every timed request")
    p.add_argument("--output-json", required=True)
    args = p.parse_args(argv)
    result = run(args)
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.2f} total "
          f"tokens/s, {result['output_tokens_per_s']:.2f} output tokens/s (vLLM {result['vllm_version']}, "
          f"runner {result['runner']}, startup {result['startup_s']:.1f} s)", flush=True)
    if result["structured_validity"]:
        print(f"Structured outputs: {result['structured_validity']}", flush=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
