"""`mrv2-jax` command line: generate, serve, convert, bench."""

import argparse
import atexit
import os
import sys

from mrv2_jax import envs
from mrv2_jax.config import ENGINE_STARTUP_TIMEOUT, SERVER_SHUTDOWN_TIMEOUT, KernelConfig
from mrv2_jax.engine.engine_config import DEFAULT_UNROLLED_LAYERS_MAX_TOKENS, EngineConfig
from mrv2_jax.without_torch import keep_torch_out

KERNELS_HELP = ("kernel or reference per piece, as field=value,...; fields (values): "
                + "; ".join(f"{name} ({'/'.join(allowed)})" for name, (_, allowed) in KernelConfig.CHOICES.items())
                + ". auto = the kernel on GPUs, the reference elsewhere; unset fields take their MRV2_* "
                  "variable (docs/switches.md)")


def add_engine_args(parser: argparse.ArgumentParser, compile_mode: str | None = None) -> None:
    """The engine arguments shared by every subcommand that runs a model. `compile_mode`: this
    command's default for --compile-mode ("eager" for benchmarks that time steps, so that no
    compile runs beside them; None: the engine's own default)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="preset (qwen3-0.6b, qwen3-8b, glm-4-9b-0414), "
                   "a model directory, or 'demo' (default: the small model shipped in checkpoints/)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "orbax", "dummy"],
                   help="'dummy' = random weights of the right shapes (benchmarks without weights)")
    g.add_argument("--runner", default=None, choices=["v1", "v2"], help="model runner (default: $MRV2_RUNNER or v2)")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false", default=None,
                   help="read every step's tokens before scheduling the next")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-gpu-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--max-fused-steps", type=int, default=None,
                   help="v2: up to this many decode steps in one compiled call when every running request "
                        "decodes (default 16; 1 turns fused decode off; must be 1 with --speculative-config)")
    g.add_argument("--max-fused-rows", type=int, default=EngineConfig.max_fused_rows,
                   help="v2: fused decode is compiled for batches of up to this many rows")
    g.add_argument("--stream-interval", type=int, default=EngineConfig.stream_interval, metavar="STEPS",
                   help="most decode steps a streaming request waits between chunks: while one streams, fused "
                        f"decode runs at most this many steps per call (default {EngineConfig.stream_interval}: "
                        "a chunk per step; non-streaming requests keep --max-fused-steps)")
    g.add_argument("--max-tokens-while-decoding", type=int, default=0, metavar="TOKENS",
                   help="while a request decodes, a step holds at most this many tokens (a new prompt is "
                        "prefilled in chunks that fit) if that leaves room for a 32-token chunk, so a step that "
                        "admits a prompt stays in a small bucket; 0: off (default)")
    g.add_argument("--stream-in-call", action="store_true",
                   help="serve: fused decode hands each step's tokens to the streams from inside the call, so "
                        "streaming requests keep --max-fused-steps and still get a chunk per token")
    g.add_argument("--step-twins", action="store_true",
                   help="v2 on one GPU: each step program's calls alternate between it and a second loaded copy, "
                        "so that XLA need not record its graphs again for a moved result (off by default)")
    g.add_argument("--sampler-variants", default=None,
                   help="sampler variants compiled per bucket, cheapest first, ending with 'all' "
                        "(names: greedy, plain, structured, full, all; default greedy,plain,full,all on GPUs, "
                        "all elsewhere); "
                        "each step runs the first that covers its batch; full: all but prompt logprobs")
    g.add_argument("--fused-unroll", type=int, default=1, help="decode steps per iteration of the fused loop")
    g.add_argument("--kernels", default=None, metavar="FIELD=VALUE,...", help=KERNELS_HELP)
    g.add_argument("--seed", type=int, default=0, help="seed for dummy weights")
    g.add_argument("--layer-unroll", type=int, default=1,
                   help="decoder layers per scan iteration; 0 unrolls them all (slower compile)")
    g.add_argument("--unrolled-layers-max-tokens", type=int, default=None, metavar="TOKENS",
                   help="v2: the step and fused decode programs of buckets with at most this many tokens "
                        "unroll every layer (a cheaper call for the host, less loop overhead on the device at "
                        "small batches; larger buckets keep --layer-unroll); 0: none; default "
                        f"{DEFAULT_UNROLLED_LAYERS_MAX_TOKENS} on GPUs, 0 elsewhere")
    g.add_argument("--unrolled-layers-max-rows", type=int, default=None, metavar="ROWS",
                   help="v2: only buckets of at most this many rows unroll (--unrolled-layers-max-tokens), and a "
                        "bucket of this many rows is added at each token count up to that many tokens whose own "
                        "bucket has more rows; default: no row limit")
    g.add_argument("--bucket-token-sizes", type=int, nargs="+", default=None, metavar="TOKENS",
                   help="the token counts a step is padded to, one set of compiled programs each (as vLLM's "
                        "CUDA-graph capture sizes); the largest must be --max-num-batched-tokens; default: powers "
                        "of two from 8 up. Fewer sizes: faster start, more padding per step")
    g.add_argument("--compile-mode", default=compile_mode, choices=["eager", "lazy", "background"],
                   help="compile every step program at start-up (eager), each at its first use (lazy), or "
                        "on threads beside the serving engine (background: the program store's programs load "
                        "at start-up, the engine serves at once, a step whose program is not ready yet compiles "
                        "or waits for it); default: " + (compile_mode or "lazy on CPUs, background on GPUs"))
    g.add_argument("--program-store", default=None, action=argparse.BooleanOptionalAction,
                   help="keep compiled step programs on disk by what they are built from, beside the compilation "
                        "cache, so that a warm start loads them without tracing; default: on GPUs with one device")
    g.add_argument("--tensor-parallel-size", type=int, default=EngineConfig.tensor_parallel_size, metavar="N",
                   help="split the decoder layers and the KV cache over the first N devices of this host "
                        "(dense Qwen3, Qwen3-MoE with --enable-expert-parallel; v2 runner; docs/parallelism.md; "
                        "default 1)")
    g.add_argument("--pipeline-parallel-size", type=int, default=EngineConfig.pipeline_parallel_size, metavar="N",
                   help="split the decoder layers and the KV cache into N pipeline stages over the first N devices "
                        "of this host (one layer group, e.g. dense Qwen3 or GLM-4; v1 or v2 runner; not with "
                        "--tensor-parallel-size; default 1)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE (Qwen3-MoE): split the experts whole over the --tensor-parallel-size devices, "
                        "num_experts / N each (docs/parallelism.md)")
    g.add_argument("--num-processes", type=int, default=None, metavar="P",
                   help="one engine over P processes (hosts), each started with the same command and prompts and "
                        "its own --process-id; --tensor-parallel-size spans all of them (offline generate only, "
                        "not serve; docs/parallelism.md, Several hosts; default $MRV2_NUM_PROCESSES or 1)")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="with --num-processes: process 0's address, the same for every process "
                        "(default $MRV2_COORDINATOR_ADDRESS, else JAX's cluster detection)")
    g.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="with --num-processes: this process's rank, 0 .. P - 1 "
                        "(default $MRV2_PROCESS_ID, else JAX's cluster detection)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'; '
                        "methods: ngram (prompt_lookup_min/max), draft_model (model), mtp, "
                        "synthetic (acceptance_rate); rejection_sampling: strict (default) or probabilistic")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k in EngineConfig.field_names()}


def cmd_generate(args) -> int:
    from mrv2_jax.llm import LLM
    from mrv2_jax.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.sampling_seed,
                            stop=args.stop or None, ignore_eos=args.ignore_eos)
    kwargs = engine_kwargs(args)
    greedy = args.temperature == 0 and args.repetition_penalty == 1.0
    if greedy and kwargs.get("sampler_variants") is None:
        # The one request is greedy: list the greedy variant first, so that (compiled at first use) it
        # is the only one compiled (on CPUs the default is `all` alone, a larger program to compile).
        kwargs["sampler_variants"] = "greedy,all"
    llm = LLM(**kwargs, show_progress=False)
    prompt = args.prompt
    if args.chat:
        if llm.tokenizer is None or not llm.tokenizer.chat_template:
            raise SystemExit("error: --chat needs a tokenizer with a chat template")
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   tokenize=False, add_generation_prompt=True)
    if llm.tokenizer is None:
        raise SystemExit("error: this model has no tokenizer; text prompts need one (use --tokenizer)")
    sys.stdout.write(args.prompt if not args.chat else "")
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_convert(args) -> int:
    from mrv2_jax.models.checkpoint import convert
    from mrv2_jax.models.loader import load_model

    _, lm, src = load_model(args.hf_dir, dtype=args.dtype, load_format="safetensors")
    out = convert(src, lm, args.out_dir)
    print(f"wrote {out} (orbax params + config/tokenizer files); load it with --model {out}")
    return 0


def _import_for_serving() -> None:
    """What the API process needs once the engine is ready (FastAPI and the server), imported on a
    thread while the engine process starts instead of before or after (the tokenizer loads on a
    thread of its own: core_client.py)."""
    from mrv2_jax.entrypoints.openai_server import import_lazy_modules

    import_lazy_modules()


def cmd_serve(args) -> int:
    import atexit
    import json
    import logging
    import shutil
    import tempfile
    import threading

    from mrv2_jax.async_llm import AsyncLLM
    from mrv2_jax.engine.distributed import refuse_serving
    from mrv2_jax.entrypoints.api_servers import default_api_server_count
    from mrv2_jax.gc_heap import prepare_serving_heap
    from mrv2_jax.process_clock import process_age_s

    refuse_serving(args.num_processes)  # before any process or thread starts
    if args.api_server_count is None:
        args.api_server_count = 1 if args.engine_in_process else default_api_server_count()
    # Where this process's start-up goes (seconds since it started), logged once it serves.
    startup = {"serve_entered_s": process_age_s()}

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    api_key = args.api_key or envs.read("MRV2_API_KEY")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: serving on {args.host} without an API key: anyone who can reach this port can "
              "use the model (set --api-key or MRV2_API_KEY)", file=sys.stderr)
    names = args.served_model_name or [args.model or "demo"]
    from mrv2_jax.core_client import EngineStartupError

    if args.api_server_count > 1:  # request metrics added up over the API processes (server_metrics.py)
        metrics_dir = tempfile.mkdtemp(prefix="mrv2-metrics-")
        atexit.register(shutil.rmtree, metrics_dir, ignore_errors=True)
        envs.set_prometheus_multiproc_dir(metrics_dir)
    importer = threading.Thread(target=_import_for_serving, name="mrv2-imports", daemon=True)
    importer.start()
    try:
        engine = AsyncLLM.from_engine_args(**engine_kwargs(args), engine_in_process=args.engine_in_process,
                                           startup_timeout=args.engine_startup_timeout,
                                           api_server_count=args.api_server_count,
                                           data_parallel_size=args.data_parallel_size)
    except EngineStartupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    startup["engine_ready_s"] = process_age_s()
    importer.join()
    from mrv2_jax.entrypoints.openai_server import serve

    startup["server_imports_done_s"] = process_age_s()
    startup["gc_frozen_objects"] = prepare_serving_heap()
    logging.getLogger("mrv2_jax.serve").info("API process start-up: %s", json.dumps(startup))

    processes = f" ({args.api_server_count} API server processes)" if args.api_server_count > 1 else ""
    print(f"serving {names[0]!r} on http://{args.host}:{args.port}/v1{processes} (Ctrl-C to stop)", file=sys.stderr)
    try:
        serve(engine, args.host, args.port, log_level=args.log_level, served_model_names=names,
              api_key=api_key, max_body_bytes=args.max_request_body_bytes, shutdown_timeout=args.shutdown_timeout,
              api_server_count=args.api_server_count, startup_timeout=args.engine_startup_timeout)
    except RuntimeError as e:  # an API server process that did not start (the engine is stopped)
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


BENCHMARKS = {
    "throughput": ("mrv2_jax.bench.throughput", "offline throughput on random prompts (as `vllm bench throughput`)"),
    "ab": ("mrv2_jax.bench.ab", "the runner A/B: v1, v2-sync, v2-async on one workload, with --plot"),
    "spec": ("mrv2_jax.bench.spec_decode", "speculative decoding: tok/s and TPOT, spec on vs off, v2-async vs v1"),
    "serve": ("mrv2_jax.bench.serve", "online serving against an OpenAI-compatible server (as `vllm bench serve`)"),
    "timeline": ("mrv2_jax.bench.timeline", "per-step host breakdown and GPU busy fraction (jax.profiler trace)"),
    "serve-compare": ("mrv2_jax.bench.serve_compare", "mrv2-jax serve vs vllm serve, same client, a concurrency sweep"),
    "compare": ("mrv2_jax.bench.compare", "side by side with vLLM (MRV2 and V1) on one GPU, with --plot"),
    "xla-vs-cudagraph": ("mrv2_jax.bench.xla_vs_cudagraph", "a decode step: XLA command buffers vs a CUDA graph"),
    "fused": ("mrv2_jax.bench.fused_decode", "small-batch decode latency with and without fused decode"),
}


def cmd_bench(args) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.benchmark][0])
    module.main(args.bench_args, prog=f"mrv2-jax bench {args.benchmark}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mrv2-jax", description="JAX/XLA inference for Qwen and GLM models")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    # One prompt runs at a time: an engine of one row compiles the fewest step variants.
    gen.set_defaults(func=cmd_generate, max_num_seqs=1, max_num_batched_tokens=256)

    srv = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
                    "/v1/chat/completions (with stream=true), /v1/models, /health, /metrics. "
                    "See docs/serving.md.")
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="model to serve (same as --model; default: demo)")
    http = srv.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 = all interfaces)")
    http.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    http.add_argument("--api-key", default=None, metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                           "(default: $MRV2_API_KEY; none = open)")
    http.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                      help="name(s) clients use in the 'model' field (default: the model argument)")
    http.add_argument("--max-request-body-bytes", type=int, default=1 << 20, metavar="BYTES",
                      help="larger request bodies get 413 (default 1 MiB)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    http.add_argument("--shutdown-timeout", type=float, default=SERVER_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                      help="on SIGTERM or Ctrl-C, stop accepting and give requests in flight this long to "
                           f"finish (default {SERVER_SHUTDOWN_TIMEOUT:.0f})")
    http.add_argument("--engine-in-process", action="store_true",
                      help="run the engine on a thread of the server process instead of its own process "
                           "(debugging; the server then shares one GIL with the engine)")
    http.add_argument("--api-server-count", type=int, default=None, metavar="N",
                      help="API server processes sharing the port and the engine: each does HTTP, tokenization, "
                           "detokenization and streaming for its own connections, so that hundreds of streams "
                           "keep up (default: one per 4 CPU cores, at most 4; 1 with --engine-in-process)")
    http.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                      help="engine replicas, one process and one device each (the i-th of CUDA_VISIBLE_DEVICES); "
                           "each request goes to the replica with the fewest open requests (default 1)")
    http.add_argument("--engine-startup-timeout", type=float, default=ENGINE_STARTUP_TIMEOUT, metavar="SECONDS",
                      help=f"how long to wait for the engine process to load and compile "
                           f"(default {ENGINE_STARTUP_TIMEOUT:.0f})")
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve, show_progress=True)

    conv = sub.add_parser("convert", help="convert a Hugging Face checkpoint to orbax (faster loads)")
    conv.add_argument("hf_dir")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="bfloat16")
    conv.set_defaults(func=cmd_convert)

    bench = sub.add_parser(
        "bench", help="benchmarks: " + ", ".join(BENCHMARKS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a benchmark; the arguments after its name are its own "
                    "(see `mrv2-jax bench BENCHMARK --help`).\n\nbenchmarks:\n"
                    + "\n".join(f"  {name:18} {text}" for name, (_, text) in BENCHMARKS.items()),
        epilog="example: mrv2-jax bench throughput --model qwen3-0.6b --load-format dummy "
               "--input-len 128 --output-len 128 --num-prompts 1000 --output-json out.json")
    bench.add_argument("benchmark", choices=list(BENCHMARKS), metavar="BENCHMARK",
                       help="one of: " + ", ".join(BENCHMARKS))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="...",
                       help="the benchmark's own arguments")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        # Straight to the benchmark, so that its options (--help included) are all its own.
        args = argparse.Namespace(func=cmd_bench, benchmark=argv[1], bench_args=argv[2:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run_as_program() -> int:
    """`mrv2-jax ...` run as a command: a `serve` process never uses torch, so transformers is kept
    from importing it (mrv2_jax/without_torch.py); `main` itself leaves the caller's process as is.

    `generate` runs its exit handlers (background compiles stopped and waited for) and then leaves
    without the interpreter's teardown: rarely, a C++ runtime thread still joinable while static
    destructors run aborts the process after the command has finished ("terminate called without an
    active exception"), which would turn its exit status 0 into a crash. It starts no other process."""
    if sys.argv[1:2] == ["serve"]:
        keep_torch_out()
    code = main()
    if sys.argv[1:2] == ["generate"]:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(run_as_program())
