"""vLLM's own decode step as the `vllm-cudagraph` arm of `bench xla-vs-cudagraph`: the FULL CUDA
graph that vLLM captured for a decode batch of B rows, replayed at each batch size B.

That graph is what vLLM replays per decode step of B rows: the model forward, from its input
buffers to the last hidden states. vLLM prepares the inputs before it and computes the logits (LM
head) and samples after it, outside the graph; our step does all of these in one call.

Run by `bench xla-vs-cudagraph` with vLLM's interpreter and environment: vLLM's packages on
PYTHONPATH, VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine core, and so the model runner, live in
this process) and VLLM_USE_V2_MODEL_RUNNER=1|0. It imports only the standard library, torch and
vLLM; it runs as a module (as bench compare's vLLM arm does), since run as a file its folder would
come first on sys.path, and trace.py there would hide the standard library's:

    PYTHONPATH=/tmp/site:. VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 -m mrv2_jax.bench.vllm_decode_graph \
        --model /tmp/qwen3-0.6b --batches 1,32,256 --context 512 --output-json vllm_graph.json

Per batch size B, B random prompts of `context - 1` tokens are generated until every row decodes.
At the first step that decodes exactly B rows, vLLM's replay of its graph for B runs as usual and
is then followed by the timed replays, with that step's real inputs (each replay writes the same
KV slots and hidden states, so the engine's own step is unchanged):
  sync_ms       median wall time of one replay() launched and waited for (torch.cuda.synchronize)
  launch_ms     median wall time of the replay() call alone (the host's cost of one replay)
  device_ms     median time between CUDA events recorded around one replay
  pipelined_ms  wall time per replay of --runs replays back to back, waited for once
If no step decoded exactly B rows, the graph is replayed after the generate with the inputs the
last step left (`inputs` says which). The result is one JSON object, the last line on stdout and
--output-json: the runner and graph mode found, per batch size the timings or an error, or
`skipped` with what was missing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import traceback
from pathlib import Path

# Where vLLM 0.22.1 keeps the model runner when the engine core runs in this process (getattr
# chains from the LLM object; vllm/entrypoints/llm.py, v1/engine/llm_engine.py, core_client.py
# InprocClient, v1/executor/uniproc_executor.py, v1/worker/worker_base.py, v1/worker/gpu_worker.py).
RUNNER_PATHS = (
    "llm_engine.model_executor.driver_worker.worker.model_runner",
    "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner",
    "llm_engine.model_executor.driver_worker.model_runner",
)
IN_GRAPH = ("the model forward from vLLM's input buffers to the last hidden states; input preparation, "
            "the LM head and sampling run outside the graph")


class Missing(Exception):
    """Something this script looks for in vLLM is not where vLLM 0.22.1 keeps it."""


def resolve(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def find_runner(llm) -> tuple[object, str]:
    for path in RUNNER_PATHS:
        try:
            return resolve(llm, path), path
        except AttributeError:
            continue
    client = type(getattr(llm.llm_engine, "engine_core", None)).__name__
    raise Missing(f"no model runner at llm.{' or llm.'.join(RUNNER_PATHS)} (engine core client: {client}; "
                  "VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine core in this process)")


class CapturedGraph:
    """One captured graph and how to put something in its place in vLLM's table of graphs."""

    def __init__(self, graph, key, table, slot):
        self.graph, self.key, self._table, self._slot = graph, key, table, slot

    def install(self, replacement) -> None:
        if isinstance(self._table, dict):
            self._table[self._slot] = replacement
        else:
            setattr(self._table, self._slot, replacement)

    def restore(self) -> None:
        self.install(self.graph)


class GraphTable:
    """The FULL decode graphs of either runner: Model Runner V2 keeps them in its
    ModelCudaGraphManager (`runner.cudagraph_manager.graphs`, BatchExecutionDescriptor -> graph,
    vllm/v1/worker/gpu/cudagraph_utils.py); the V1 runner wraps its model in a FULL-mode
    CUDAGraphWrapper (`runner.model.concrete_cudagraph_entries`, BatchDescriptor -> entry with
    `.cudagraph`, vllm/compilation/cuda_graph.py)."""

    def __init__(self, runner):
        cls = type(runner)
        self.runner_class = f"{cls.__module__}.{cls.__name__}"
        manager = getattr(runner, "cudagraph_manager", None)
        model = getattr(runner, "model", None)
        if manager is not None and isinstance(getattr(manager, "graphs", None), dict):
            self.runner = "v2"
            self.mode = getattr(getattr(manager, "cudagraph_mode", None), "name", None)
            self.graphs = manager.graphs
        elif isinstance(getattr(model, "concrete_cudagraph_entries", None), dict):
            self.runner = "v1"
            self.mode = getattr(getattr(runner.compilation_config, "cudagraph_mode", None), "name", None)
            wrapper_mode = getattr(getattr(model, "runtime_mode", None), "name", None)
            if wrapper_mode != "FULL":
                raise Missing(f"the V1 runner's model wrapper replays {wrapper_mode} graphs, not FULL ones "
                              f"(cudagraph_mode {self.mode})")
            self.graphs = model.concrete_cudagraph_entries
        else:
            raise Missing(f"{self.runner_class} has neither cudagraph_manager.graphs (Model Runner V2) nor "
                          f"model.concrete_cudagraph_entries (V1 runner; its model is {type(model).__name__})")
        self.capture_sizes = list(getattr(runner.compilation_config, "cudagraph_capture_sizes", None) or [])

    def find(self, batch: int) -> CapturedGraph:
        """The FULL graph that a decode step of `batch` rows replays, as vLLM picks it: the smallest
        one of at least `batch` tokens and rows, one captured for uniform decode batches first."""
        found = []
        for key, value in self.graphs.items():
            tokens, rows = getattr(key, "num_tokens", 0), getattr(key, "num_reqs", None)
            if tokens < batch or (rows is not None and rows < batch):
                continue
            if self.runner == "v2":
                if getattr(getattr(key, "cg_mode", None), "name", None) != "FULL":
                    continue
                uniform = getattr(key, "uniform_token_count", None) is not None
                found.append((tokens, not uniform, CapturedGraph(value, key, self.graphs, key)))
            elif getattr(value, "cudagraph", None) is not None:
                uniform = bool(getattr(key, "uniform", False))
                found.append((tokens, not uniform, CapturedGraph(value.cudagraph, key, value, "cudagraph")))
        if not found:
            sizes = sorted({getattr(k, "num_tokens", -1) for k in self.graphs})
            raise Missing(f"no FULL graph for {batch} rows (cudagraph_mode {self.mode}; graphs for {sizes} tokens; "
                          f"capture sizes {self.capture_sizes})")
        return min(found, key=lambda f: f[:2])[2]


def time_replays(replay, runs: int, warmup: int) -> dict:
    import torch

    torch.cuda.synchronize()
    for _ in range(warmup):
        replay()
    torch.cuda.synchronize()
    launch, sync = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        sync.append(time.perf_counter() - t0)
        launch.append(t1 - t0)
    device = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end))
    t0 = time.perf_counter()
    for _ in range(runs):
        replay()
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - t0) / runs
    return {"sync_ms": 1e3 * statistics.median(sync), "launch_ms": 1e3 * statistics.median(launch),
            "device_ms": statistics.median(device), "pipelined_ms": 1e3 * pipelined, "runs": runs}


class StepShape:
    """Wraps the runner's execute_model (an attribute of this one instance) to note each step's
    (rows, tokens) and the rows' context lengths before vLLM runs it."""

    def __init__(self, runner):
        self.runner, self.shape, self.context = runner, None, None
        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self.shape = (len(scheduler_output.num_scheduled_tokens), scheduler_output.total_num_scheduled_tokens)
            try:
                computed = scheduler_output.scheduled_cached_reqs.num_computed_tokens
                self.context = (min(computed) + 1, max(computed) + 1) if computed else None
            except AttributeError:
                self.context = None
            return original(scheduler_output, *args, **kwargs)

        runner.execute_model = execute_model

    def remove(self) -> None:
        del self.runner.execute_model


class ReplayProbe:
    """Stands in for one captured graph while its batch size runs: at the first replay in a step
    of exactly `batch` decode rows, vLLM's replay runs, then the timed ones."""

    def __init__(self, graph, batch: int, step: StepShape, args):
        self.graph, self.batch, self.step, self.args, self.result = graph, batch, step, args, None

    def replay(self):
        out = self.graph.replay()
        if self.result is None and self.step.shape == (self.batch, self.batch):
            self.result = time_replays(self.graph.replay, self.args.runs, self.args.warmup) | {
                "inputs": f"a live decode step of {self.batch} rows", "context": self.step.context}
        return out

    def __getattr__(self, name):
        return getattr(self.graph, name)


def graph_param_bytes(model) -> tuple[int, int]:
    """(bytes of the weights the graph reads, of all weights): the graph gathers a few rows of the
    embedding table and never touches the LM head (it runs after the graph)."""
    total = inside = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size
        if "embed_tokens" not in name and "lm_head" not in name:
            inside += size
    return inside, total


def engine_argv(args, max_model_len: int) -> list[str]:
    argv = ["--model", args.model, "--load-format", args.load_format, "--dtype", args.dtype,
            "--max-num-seqs", str(max(args.batches)), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(max_model_len), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--attention-backend", args.attention_backend]
    if args.capture_sizes:
        argv += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": args.capture_sizes})]
    return argv


def run(args) -> dict:
    try:
        import torch
        import vllm
    except ImportError as e:
        return {"skipped": f"torch/vllm do not import here ({e})"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device", "vllm_version": getattr(vllm, "__version__", None)}
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # Steps that prefill every prompt (chunks of the token budget), then decodes for all rows.
    max_tokens = {b: -(-b * args.context // args.max_num_batched_tokens) + 8 for b in args.batches}
    max_model_len = max(1024, -(-(args.context + max(max_tokens.values())) // 256) * 256)
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    argv = engine_argv(args, max_model_len)
    t0 = time.perf_counter()
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(parser.parse_args(argv)))
    startup = time.perf_counter() - t0
    about = {"engine": "vllm", "vllm_version": vllm.__version__, "torch_version": torch.__version__,
             "device": torch.cuda.get_device_name(), "engine_argv": argv, "startup_s": startup, "in_graph": IN_GRAPH}
    try:
        runner, path = find_runner(llm)
        table = GraphTable(runner)
        model = runner.get_model()
    except (Missing, AttributeError) as e:
        return about | {"skipped": f"{type(e).__name__}: {e}"}
    inside, total = graph_param_bytes(model)
    about |= {"runner": table.runner, "runner_class": table.runner_class, "runner_path": f"llm.{path}",
              "cudagraph_mode": table.mode, "capture_sizes": table.capture_sizes, "param_bytes": inside,
              "param_bytes_total": total}
    print(f"vllm-cudagraph: runner {table.runner} ({table.runner_class}) at llm.{path}, cudagraph_mode "
          f"{table.mode}", flush=True)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    top = vocab - 1000 if vocab > 2000 else vocab
    results = {}
    step = StepShape(runner)
    try:
        for batch in args.batches:
            try:
                captured = table.find(batch)
            except Missing as e:
                results[batch] = {"error": str(e)}
                continue
            gen = random.Random(batch)
            prompts = [{"prompt_token_ids": [gen.randrange(top) for _ in range(args.context - 1)]}
                       for _ in range(batch)]
            probe = ReplayProbe(captured.graph, batch, step, args)
            captured.install(probe)
            try:
                llm.generate(prompts, SamplingParams(max_tokens=max_tokens[batch], temperature=0.0, ignore_eos=True,
                                                     detokenize=False), use_tqdm=False)
            finally:
                captured.restore()
            result = probe.result or time_replays(captured.graph.replay, args.runs, args.warmup) | {
                "inputs": f"left over from the generate's last step (no step decoded exactly {batch} rows)"}
            results[batch] = result | {"graph": repr(captured.key), "graph_tokens": captured.key.num_tokens,
                                       "param_bytes": inside}
            print(f"  batch {batch:4}: sync {result['sync_ms']:.3f} ms, device {result['device_ms']:.3f} ms, "
                  f"pipelined {result['pipelined_ms']:.3f} ms ({result['inputs']})", flush=True)
    finally:
        step.remove()
    return about | {"batches": results}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/qwen3-0.6b", help="a model directory (config.json) for vLLM")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,32,256", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--context", type=int, default=512, help="tokens of context each row attends to")
    p.add_argument("--runs", type=int, default=100, help="timed replays per measurement")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--attention-backend", default="FLASH_ATTN")
    p.add_argument("--capture-sizes", default=None, type=lambda s: [int(x) for x in s.split(",")],
                   help="vLLM's cudagraph_capture_sizes (default: vLLM's, which include 1, 32 and 256)")
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        result = run(args)
    except Exception as e:  # noqa: BLE001 - the report names the failure, so one device run tells what to fix
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e)[:1000]}"}
    line = json.dumps(result, default=str)
    if args.output_json:
        Path(args.output_json).write_text(line + "\n")
    print(line, flush=True)
    return result


if __name__ == "__main__":
    main()
