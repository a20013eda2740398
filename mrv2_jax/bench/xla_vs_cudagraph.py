"""XLA vs CUDA graphs: one Qwen3 decode step (every row decodes one token against a context of
--context tokens, greedy sampling included) at several batch sizes, timed as

    jax-cmdbuf        our V2 runner step (input prep + forward + sampling), XLA's default set of
                      command buffers
    jax-no-cmdbuf     the same with XLA_FLAGS=--xla_gpu_enable_command_buffer= (every kernel
                      launched on its own)
    jax-cmdbuf-while  the same with WHILE added to the command-buffer set (the layer loop is a
                      lax.scan, which XLA's default set leaves outside the command buffers):
                      the engine's default (mrv2_jax/xla_flags.py)
    torch-cudagraph   the Hugging Face PyTorch model (random weights from the same config.json),
                      a StaticCache, the step captured once in a CUDA graph and replayed
    torch-eager       the same model and cache, launched eagerly
    torch-compile     torch.compile(mode="reduce-overhead") of the step (slow to compile; opt in)
    vllm-cudagraph    vLLM's own FULL CUDA graph for a decode batch of that size, replayed with the
                      inputs of a real decode step (vllm_decode_graph.py): the model forward only,
                      without vLLM's input preparation, LM head and sampling

    python -m mrv2_jax.bench.xla_vs_cudagraph --model qwen3-0.6b --batches 1,32,256 --context 512 \
        --output-json xla_vs_cudagraph.json

Each arm runs in its own process (XLA reads its flags once per process), one after the other.
Per batch size and arm:
  sync_ms        median wall time of one step launched and waited for: what one step costs
                 when nothing overlaps its launch (launch overhead fully exposed)
  pipelined_ms   wall time per step of --runs steps launched back to back, waited for once
  floor_ms       (weight bytes + KV bytes read) / 4.3 TB/s, the memory-bandwidth floor
  overhead_ms    sync_ms - floor_ms: launch overhead plus kernels' distance from the floor
  device_ms      (vllm-cudagraph) CUDA-event time of one replay
Our batch-1 step runs in the engine's smallest bucket (8 rows; 7 padded), as the engine does.
The PyTorch arms need torch and transformers (--torch-python picks the interpreter) and, for
the graph, CUDA; without them they are reported as skipped with the reason. So is the vLLM arm
where vLLM does not import (--vllm-python, --vllm-site, as in `bench compare`) or there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mrv2_jax import envs
from mrv2_jax.bench.compare import vllm_available, vllm_env
from mrv2_jax.bench.environment import describe_environment, write_report

REPO_ROOT = str(Path(__file__).resolve().parents[2])
COPY_BANDWIDTH = 4.3e12  # bytes/s, measured on the H200 (../shared/reference/measured_h200.md)
# XLA's command-buffer setting per arm (None: XLA's own default set, without WHILE).
JAX_ARMS = {"jax-cmdbuf": None, "jax-no-cmdbuf": "--xla_gpu_enable_command_buffer=",
            "jax-cmdbuf-while": "--xla_gpu_enable_command_buffer=+WHILE"}
TORCH_ARMS = ("torch-cudagraph", "torch-eager", "torch-compile")
VLLM_ARM = "vllm-cudagraph"
VLLM_MODULE = "mrv2_jax.bench.vllm_decode_graph"
DEFAULT_ARMS = "jax-cmdbuf-while,jax-cmdbuf,jax-no-cmdbuf,torch-cudagraph,torch-eager,vllm-cudagraph"
NOTES = [
    "jax-*: our whole decode step in one call: input preparation, the forward, the LM head and greedy sampling.",
    "torch-*: the Hugging Face model's forward, the LM head and an argmax.",
    ("vllm-cudagraph: vLLM's captured FULL decode graph, the model forward only: vLLM prepares the inputs before "
     "it and computes the logits and samples after it, outside the graph, so it does less than our step. Its "
     "floor counts the weights the graph reads (not the embedding table or the LM head)."),
]


def floor_ms(param_bytes: int, kv_bytes: int) -> float:
    return 1e3 * (param_bytes + kv_bytes) / COPY_BANDWIDTH


def kv_bytes_read(config: dict, batch: int, context: int, dtype_bytes: int = 2) -> int:
    """K and V of every layer for `context` tokens of `batch` rows."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes
    return batch * context * per_token


def timings(sync_samples: list[float], pipelined_total: float, runs: int) -> dict:
    return {"sync_ms": 1e3 * statistics.median(sync_samples), "pipelined_ms": 1e3 * pipelined_total / runs}


# --- the JAX arm (runs in its own process) ---------------------------------------------------
def jax_worker(args) -> dict:
    """Our V2 engine with max_num_seqs = the largest batch; per batch size, `batch` prompts of
    `context - 1` tokens run into decode, the second full-batch decode step is captured and
    replayed one at a time (sync) and back to back (pipelined)."""
    import jax

    from mrv2_jax.bench.capture import DecodeStepCapture, replay
    from mrv2_jax.bench.dataset import random_prompts
    from mrv2_jax.bench.step_log import attach_hooks
    from mrv2_jax.llm import LLM
    from mrv2_jax.sampling_params import SamplingParams

    # One dispatch per decode step (fused decode off): the arms compare single steps.
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, runner="v2", async_scheduling=True,
              max_num_seqs=max(args.batches), max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.context + 2 * args.runs + 64, max_fused_steps=1, show_progress=False)
    runner = llm.engine.runner
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.params.leaves))
    results = {}
    for batch in args.batches:
        prompts = random_prompts(batch, args.context - 1, 0.0, llm.model_state.vocab_size, seed=batch)
        capture = DecodeStepCapture(runner, rows=batch, which=2)
        attach_hooks(llm.engine, capture)
        # The prompts are prefilled over several steps (token budget): the first ones must
        # still be decoding when the last prefill is done, so that full-batch steps happen.
        prefill_steps = -(-batch * args.context // args.max_num_batched_tokens)
        llm.generate(prompts, SamplingParams(max_tokens=prefill_steps + 4, ignore_eos=True), use_tqdm=False)
        attach_hooks(llm.engine, None)
        if not capture.captured:
            results[batch] = {"error": "no full-batch decode step was captured"}
            continue
        capture.restore_state()
        replay(capture.dispatch, args.warmup)
        capture.restore_state()
        sync = [replay(capture.dispatch, 1)[0] for _ in range(args.runs)]
        capture.restore_state()
        pipelined = replay(capture.dispatch, args.runs)[0] * args.runs
        kv = batch * args.context * llm.model_state.kv_bytes_per_token(runner.kv_cache[0].dtype)
        results[batch] = timings(sync, pipelined, args.runs) | {"param_bytes": param_bytes, "kv_bytes": kv}
        print(f"  batch {batch:4}: sync {results[batch]['sync_ms']:.3f} ms, pipelined "
              f"{results[batch]['pipelined_ms']:.3f} ms", flush=True)
    return {"backend": jax.default_backend(), "xla_flags": envs.get_xla_flags(),
            "batches": results}


# --- the PyTorch arms (run in their own process) ----------------------------------------------
def torch_worker(args) -> dict:
    """The Hugging Face model from the same config.json with random weights, a StaticCache of
    `context` tokens filled by a prefill of `context - 1`, and a decode step (forward + argmax)
    that attends to all `context` cache entries (a ready mask over the whole static cache)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, StaticCache
    except ImportError as e:
        return {"skipped": f"torch/transformers not importable here ({e}); --torch-python picks another Python"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wanted = [a for a in args.torch_arms if a in TORCH_ARMS]
    skipped = {}
    if device == "cpu":
        for arm in ("torch-cudagraph", "torch-compile"):
            if arm in wanted:
                skipped[arm] = "needs CUDA"
        wanted = [a for a in wanted if a not in skipped]
        if not args.allow_cpu:
            return {"skipped": "no CUDA device (pass --allow-cpu to time eager PyTorch on the CPU)"}
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    config = AutoConfig.from_pretrained(args.model_dir)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sync_device = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if args.context - 1 - (max(args.warmup, args.runs) + 4) < 0:
        raise ValueError(f"--context {args.context} is too short for {args.runs} runs per loop")
    results = {arm: {} for arm in wanted}
    for batch in args.batches:
        step, rewind = decode_step(model, config, StaticCache(config=config, max_cache_len=args.context), batch,
                                   args, torch, device)
        for arm in wanted:
            try:
                rewind()
                launch = make_launcher(arm, step, torch)
                results[arm][batch] = time_torch(launch, sync_device, rewind, args) | {
                    "param_bytes": param_bytes,
                    "kv_bytes": kv_bytes_read(config.to_dict(), batch, args.context, dtype_bytes=dtype.itemsize)}
                print(f"  {arm} batch {batch:4}: sync {results[arm][batch]['sync_ms']:.3f} ms, pipelined "
                      f"{results[arm][batch]['pipelined_ms']:.3f} ms", flush=True)
            except Exception as e:  # noqa: BLE001 - one arm failing must not lose the others
                results[arm][batch] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                print(f"  {arm} batch {batch}: failed: {results[arm][batch]['error']}", flush=True)
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch_version": torch.__version__,
            "arms": {arm: {"batches": r} for arm, r in results.items()} | {a: {"skipped": why}
                                                                           for a, why in skipped.items()}}


def decode_step(model, config, cache, batch: int, args, torch, device: str):
    """-> (step, rewind): `step()` launches one decode step of `batch` rows (forward + argmax)
    after a prefill of `context - 1` tokens; `rewind()` winds the cache's write index back. That
    index lives on the device and every step advances it (inside the graph too), so it is wound
    back before each timed loop, which then cannot run off the end of the cache."""
    gen = torch.Generator(device="cpu").manual_seed(batch)
    top = config.vocab_size - 1000 if config.vocab_size > 2000 else config.vocab_size
    with torch.no_grad():
        prompt = torch.randint(0, top, (batch, args.context - 1), generator=gen).to(device)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    ids = torch.randint(0, top, (batch, 1), generator=gen).to(device)
    position = torch.full((batch, 1), args.context - 1, device=device)
    cache_position = torch.tensor([args.context - 1], device=device)
    # A ready 4D mask over the whole static cache: the model uses it as is, so no mask is built
    # (or synchronised on) per step, and every step attends to `context` entries.
    mask = torch.ones(batch, 1, 1, args.context, dtype=torch.bool, device=device)
    rewind_to = args.context - 1 - (max(args.warmup, args.runs) + 4)

    def step():
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=position, cache_position=cache_position, attention_mask=mask,
                        past_key_values=cache, use_cache=True)
            return out.logits[:, -1].argmax(-1)

    def rewind():
        for layer in cache.layers:
            layer.cumulative_length.fill_(rewind_to)

    return step, rewind


def make_launcher(arm: str, step, torch):
    """A function that launches one step (without waiting for it)."""
    if arm == "torch-eager":
        return step
    if arm == "torch-compile":
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=False)
        for _ in range(3):  # compile, then record the graphs
            compiled()
        return compiled
    # torch-cudagraph: warm up on a side stream (as torch.cuda.graphs asks), capture once.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def time_torch(launch, synchronize, rewind, args) -> dict:
    rewind()
    for _ in range(args.warmup):
        launch()
    synchronize()
    rewind()
    sync = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        launch()
        synchronize()
        sync.append(time.perf_counter() - t0)
    rewind()
    t0 = time.perf_counter()
    for _ in range(args.runs):
        launch()
    synchronize()
    return timings(sync, time.perf_counter() - t0, args.runs)


# --- the orchestrator ------------------------------------------------------------------------
def run_json_process(kind: str, make_argv: Callable[[str], list[str]], env: dict, timeout: float) -> dict:
    """Run one arm's process, `make_argv(path)`; its result comes back through the JSON file `path`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        t0 = time.perf_counter()
        try:
            run = subprocess.run(make_argv(out), env=env, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"error": f"the {kind} process did not run: {e}"}
        if run.returncode != 0 or not os.path.exists(out):
            return {"error": f"the {kind} process exited with code {run.returncode} (its output is above)"}
        with open(out) as f:
            return json.load(f) | {"process_s": time.perf_counter() - t0}


def run_worker(kind: str, args, python: str, extra_env: dict) -> dict:
    """Run one worker process of this module."""
    make_argv = lambda out: [
        python, "-m", "mrv2_jax.bench.xla_vs_cudagraph", "--worker", kind, "--worker-json", out,
        "--model", args.model, "--model-dir", args.model_dir, "--load-format", args.load_format,
        "--dtype", args.dtype, "--batches", ",".join(map(str, args.batches)), "--context", str(args.context),
        "--runs", str(args.runs), "--warmup", str(args.warmup), "--torch-arms", ",".join(args.torch_arms),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), *(["--allow-cpu"] if args.allow_cpu else [])]
    # The worker imports this package, also from another interpreter (--torch-python).
    path = os.pathsep.join(filter(None, [REPO_ROOT, envs.read_external("PYTHONPATH")]))
    return run_json_process(kind, make_argv, envs.subprocess_env(PYTHONPATH=path, **extra_env), args.arm_timeout)


def run_vllm_arm(args) -> dict:
    """vLLM's decode graph (vllm_decode_graph.py) in vLLM's interpreter and environment, with the
    engine core in this arm's process; skipped with the reason where vLLM does not import."""
    ok, version = vllm_available(args)
    if not ok:
        return {"skipped": version}
    make_argv = lambda out: [
        args.vllm_python, "-m", VLLM_MODULE, "--model", args.vllm_model, "--load-format", args.load_format,
        "--dtype", args.dtype, "--batches", ",".join(map(str, args.batches)), "--context", str(args.context),
        "--runs", str(args.runs), "--warmup", str(args.warmup),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--output-json", out]
    env = vllm_env(args, {"v2": "1", "v1": "0"}[args.vllm_runner]) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = run_json_process(VLLM_ARM, make_argv, env, args.arm_timeout)
    config_path = Path(args.vllm_model) / "config.json"
    config = json.loads((config_path if config_path.exists() else Path(args.model_dir) / "config.json").read_text())
    for batch, r in result.get("batches", {}).items():
        if "sync_ms" in r:
            r["kv_bytes"] = kv_bytes_read(config, int(batch), args.context, 4 if args.dtype == "float32" else 2)
    return result


def collect(args) -> dict:
    from mrv2_jax.models.loader import resolve_model_path

    args.model_dir = str(resolve_model_path(args.model))
    arms = {}
    for arm in args.arms:
        if arm in JAX_ARMS:
            print(f"== {arm}", flush=True)
            # Only this arm's command-buffer setting: drop any from the environment (importing
            # mrv2_jax adds the engine's default, +WHILE: mrv2_jax/xla_flags.py).
            flags = [f for f in envs.get_xla_flags().split()
                     if not f.startswith("--xla_gpu_enable_command_buffer")]
            extra = {"XLA_FLAGS": " ".join([*flags, JAX_ARMS[arm] or ""]).strip(), "MRV2_DEFAULT_XLA_FLAGS": "0"}
            arms[arm] = run_worker("jax", args, sys.executable, extra)
    if args.torch_arms:
        print(f"== {', '.join(args.torch_arms)} ({args.torch_python})", flush=True)
        result = run_worker("torch", args, args.torch_python, {})
        for arm in args.torch_arms:
            about = {"device": result.get("device"), "torch_version": result.get("torch_version")}
            arms[arm] = result["arms"].get(arm, {"skipped": "not run"}) | about if "arms" in result else result
    if VLLM_ARM in args.arms:
        print(f"== {VLLM_ARM} ({args.vllm_python}, runner {args.vllm_runner})", flush=True)
        arms[VLLM_ARM] = run_vllm_arm(args)
    return arms


def table_rows(arms: dict, batches: list[int]) -> list[dict]:
    """One row per (batch, arm) that ran; ratios = this arm's sync time / the torch CUDA graph's
    (vs_cudagraph) and / vLLM's decode graph's (vs_vllm)."""
    rows = []
    for batch in batches:
        graph = arms.get("torch-cudagraph", {}).get("batches", {}).get(str(batch), {})
        vllm = arms.get(VLLM_ARM, {}).get("batches", {}).get(str(batch), {})
        for arm, result in arms.items():
            r = result.get("batches", {}).get(str(batch))
            if not r or "sync_ms" not in r:
                continue
            floor = floor_ms(r["param_bytes"], r["kv_bytes"])
            rows.append({"batch": batch, "arm": arm, "sync_ms": r["sync_ms"], "pipelined_ms": r["pipelined_ms"],
                         "device_ms": r.get("device_ms"), "floor_ms": floor, "overhead_ms": r["sync_ms"] - floor,
                         "vs_cudagraph": r["sync_ms"] / graph["sync_ms"] if "sync_ms" in graph else None,
                         "vs_vllm": r["sync_ms"] / vllm["sync_ms"] if "sync_ms" in vllm else None})
    return rows


def print_table(rows: list[dict], arms: dict) -> None:
    fmt = lambda v, spec, suffix="": f"{v:{spec}}{suffix}" if v is not None else "-"
    print(f"\n{'batch':>5} {'arm':18} {'sync ms':>9} {'pipelined ms':>13} {'device ms':>10} {'floor ms':>9} "
          f"{'overhead ms':>12} {'vs CUDA graph':>14} {'vs vLLM graph':>14}")
    for r in rows:
        print(f"{r['batch']:5} {r['arm']:18} {r['sync_ms']:9.3f} {r['pipelined_ms']:13.3f} "
              f"{fmt(r['device_ms'], '.3f'):>10} {r['floor_ms']:9.3f} {r['overhead_ms']:12.3f} "
              f"{fmt(r['vs_cudagraph'], '.2f', 'x'):>14} {fmt(r['vs_vllm'], '.2f', 'x'):>14}")
    for arm, result in arms.items():
        why = result.get("skipped") or result.get("error")
        if why:
            print(f"{arm}: {'skipped' if 'skipped' in result else 'failed'}: {why}")
        for batch, r in result.get("batches", {}).items():
            if "error" in r:
                print(f"{arm} batch {batch}: failed: {r['error']}")
    if VLLM_ARM in arms:
        print("\n".join(["Notes:", *NOTES]))


def parse_args(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="preset or model directory (its config.json is used)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batches", default="1,32,256", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--context", type=int, default=512, help="tokens of context each row attends to")
    p.add_argument("--runs", type=int, default=100, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--arms", default=DEFAULT_ARMS, type=lambda s: s.split(","),
                   help=f"comma-separated, from {', '.join([*JAX_ARMS, *TORCH_ARMS, VLLM_ARM])} (default "
                        f"{DEFAULT_ARMS})")
    p.add_argument("--torch-python", default=sys.executable, help="the Python with torch + transformers")
    p.add_argument("--allow-cpu", action="store_true", help="time eager PyTorch on the CPU (tests)")
    p.add_argument("--vllm-python", default="python3", help="the Python that has vLLM (default python3)")
    p.add_argument("--vllm-site", default=envs.read("MRV2_VLLM_SITE"),
                   help="a folder put first on vLLM's PYTHONPATH, e.g. /tmp/site (default $MRV2_VLLM_SITE)")
    p.add_argument("--vllm-model", default=envs.read("MRV2_VLLM_MODEL"),
                   help="a Qwen3 model directory for vLLM (config.json), the architecture of --model "
                        "(default $MRV2_VLLM_MODEL or /tmp/qwen3-0.6b)")
    p.add_argument("--vllm-runner", default="v2", choices=["v2", "v1"],
                   help="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER=1 or 0)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="our engine's token budget")
    p.add_argument("--arm-timeout", type=float, default=900.0, help="seconds before an arm's process is killed")
    p.add_argument("--output-json", default=None)
    p.add_argument("--worker", choices=["jax", "torch"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--torch-arms", default=None, type=lambda s: [a for a in s.split(",") if a], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.arms) - set(JAX_ARMS) - set(TORCH_ARMS) - {VLLM_ARM}
    if unknown:
        p.error(f"unknown arm(s): {', '.join(sorted(unknown))}")
    if args.torch_arms is None:
        args.torch_arms = [a for a in args.arms if a in TORCH_ARMS]
    return args


def main(argv=None, prog=None):
    args = parse_args(argv, prog)
    if args.worker:
        result = jax_worker(args) if args.worker == "jax" else torch_worker(args)
        with open(args.worker_json, "w") as f:
            json.dump(result, f, default=str)
        return result
    arms = collect(args)
    rows = table_rows(arms, args.batches)
    print_table(rows, arms)
    report = {**describe_environment(probe_device=False), "settings": vars(args), "arms": arms, "table": rows,
              "notes": NOTES}
    if args.output_json:
        write_report(report, args.output_json)
    return report


if __name__ == "__main__":
    main()
