"""`EngineConfig`: the one set of engine arguments shared by the offline API (`LLM(**kwargs)`), the
CLI and the server, validated when built. Importing it loads no JAX (the API server processes read
its field names); checks that need the model code load it when a config is built."""

import dataclasses
from dataclasses import dataclass

from mrv2_jax import envs
from mrv2_jax.config import KernelConfig
from mrv2_jax.engine import distributed
from mrv2_jax.engine.tokenizer import has_tokenizer
from mrv2_jax.runner.buckets import check_token_sizes
from mrv2_jax.spec_decode.config import SpeculativeConfig
from mrv2_jax.xla_flags import prefer_vmm_allocator

RUNNERS = ("v1", "v2")
# Up to 16 decode steps per call for small stable batches: one jitted call of the step costs the
# host more than a small batch's device step, so fusing steps pays (docs/benchmarks.md,
# "Small-batch decode"). `--max-fused-steps 1` turns it off.
DEFAULT_MAX_FUSED_STEPS = 16
# Fused decode is compiled for batches of up to 256 rows: it pays at 256 rows too
# (docs/benchmarks.md, "Sampler variants and fused decode at 256 rows").
DEFAULT_MAX_FUSED_ROWS = 256
# One decode step between a stream's chunks, as vLLM's default: with K > 1 a stream gets K tokens
# at once every K steps, and its inter-chunk gap is K times its time per token.
DEFAULT_STREAM_INTERVAL = 1
# On GPUs the step programs of buckets up to 256 tokens unroll their layers: a cheaper call per
# step at the small batches that serving streams one step per call, and a shorter device step for a
# full 256-row decode batch, fused or not (docs/benchmarks.md, "The 256-token buckets unrolled" and
# "The 256-token buckets unrolled by default").
DEFAULT_UNROLLED_LAYERS_MAX_TOKENS = 256


COMPILE_MODES = ("eager", "lazy", "background")


@dataclass
class EngineConfig:
    model: str | None = None  # preset, "demo" (default) or a model directory
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "bfloat16"
    load_format: str = "auto"
    runner: str | None = None  # "v1" | "v2"; default: $MRV2_RUNNER (v2)
    async_scheduling: bool | None = None  # default: on for runners that support it
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Decoder layers per lax.scan iteration (0: all, no loop). A loop whose body is one layer
    # compiles fastest; unrolled, XLA sees static weight slices and no loop control per layer.
    layer_unroll: int = 1
    # V2: the step programs and fused decode's programs of buckets with at most this many tokens
    # unroll every layer (one command buffer per call, a cheaper call for the host at small batches;
    # no loop control and static weight slices per layer on the device); larger buckets keep
    # `layer_unroll`. 0: none; None: DEFAULT_UNROLLED_LAYERS_MAX_TOKENS on one GPU
    # with the v2 runner and no speculative decoding, 0 elsewhere (the call's host cost it cuts is
    # a GPU matter, and XLA:CPU compiles unrolled programs slowly).
    unrolled_layers_max_tokens: int | None = None
    # V2: with unrolled_layers_max_tokens, only buckets of at most this many rows unroll, and a
    # bucket of this many rows is added at each token count up to it whose own bucket has more rows
    # (a step with few rows and a prompt unrolls; a full decode batch keeps the loop). None: no limit.
    unrolled_layers_max_rows: int | None = None
    # The token counts a step is padded to, one compiled program set each (as vLLM's CUDA-graph
    # capture sizes); the largest must be max_num_batched_tokens. None: powers of two from 8 up
    # (runner/buckets.py). Fewer sizes: fewer programs to compile, more padding per step.
    bucket_token_sizes: tuple[int, ...] | None = None
    # When step programs compile: "eager" (all at start-up), "lazy" (each at its first use, a
    # short stall then) or "background" (what the program store holds is loaded at start-up, the
    # rest compiles on threads while the engine serves; a step whose program is not ready compiles
    # it or waits for it); default lazy on CPUs (a few of the planned programs ever run there),
    # background on GPUs (a cold start serves in seconds, a warm one loads every program first).
    # Benchmarks that time steps default to eager (entrypoints/cli.py add_engine_args).
    compile_mode: str | None = None
    # Keep compiled step programs on disk by what they are built from (runner/program_store.py), so
    # that a warm start loads them without tracing; None: on GPUs with one device and the
    # compilation cache on.
    program_store: bool | None = None
    # V2: up to this many decode steps in one compiled call for small, stable batches
    # (runner/fused.py); default DEFAULT_MAX_FUSED_STEPS; v1 and speculative decoding need 1.
    max_fused_steps: int | None = None
    fused_unroll: int = 1  # decode steps per iteration of the fused loop (1: a plain while loop)
    # V2: fused decode is compiled for batches of up to this many rows (the smallest bucket
    # with at least that many). Larger batches decode one step per call.
    max_fused_rows: int = DEFAULT_MAX_FUSED_ROWS
    # While a streaming request runs, fused decode runs at most this many steps per call, which
    # bounds the wait between a stream's chunks (in decode steps); non-streaming requests keep K.
    stream_interval: int = DEFAULT_STREAM_INTERVAL
    # While a request decodes, a step holds at most this many tokens (prompts chunked to fit) when
    # that leaves room for a prompt chunk: SchedulerConfig.max_tokens_while_decoding; 0: off.
    max_tokens_while_decoding: int = 0
    # V2, the server's engine process: fused decode hands each step's tokens to the streams from
    # inside the call (runner/fused.py), so streaming requests keep max_fused_steps and still get
    # a chunk per token; requests with logprobs, or more stop ids than the device checks, keep
    # the stream interval. Only the server's engine process attaches a sink: elsewhere the fused
    # calls still make their callbacks, which hand the tokens to nobody.
    stream_in_call: bool = False
    # V2 on one GPU: each step program's calls alternate between it and a second loaded copy, so that
    # a call's result can land where that copy's last one was and XLA need not record its graphs
    # again (runner/step_twins.py). Off by default until measured in the engine.
    step_twins: bool = False
    # Sampler variants compiled per bucket, cheapest first, e.g. "greedy,plain,all"; each step
    # runs the first that covers its batch (sample/features.py). Default: greedy,plain,full,all on
    # GPUs, all elsewhere. Fewer variants: faster start, slower steps for some batches.
    sampler_variants: str | None = None
    seed: int = 0
    show_progress: bool = True
    # Speculative decoding: a SpeculativeConfig, a dict or a JSON string
    # ({"method": "ngram" | "draft_model" | "mtp" | "synthetic", "num_speculative_tokens": k, ...}).
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Kernel or reference for each piece that has both: a KernelConfig, a dict of its fields or
    # "field=value,..." (`--kernels`), over the environment's defaults; resolved for the backend here.
    kernels: KernelConfig | dict | str | None = None
    # Devices the decoder layers and the KV cache are split over (Megatron-style tensor
    # parallelism, docs/parallelism.md): this host's, or N / num_processes of each process's;
    # 1: one device, nothing sharded.
    tensor_parallel_size: int = 1
    # MoE families (Qwen3-MoE): split the experts whole over the tensor_parallel_size devices (each
    # holds num_experts / N of them), attention split as above; needs tensor_parallel_size > 1.
    enable_expert_parallel: bool = False
    # Devices the decoder layers and the KV cache's layer axis are split over as pipeline stages,
    # each holding num_hidden_layers / N consecutive layers (models/pipeline_parallel.py); one
    # process, not with tensor parallelism; 1: no stages.
    pipeline_parallel_size: int = 1
    # A run over several processes (hosts), each running the same offline program on the same
    # requests (engine/distributed.py); unset: $MRV2_NUM_PROCESSES, $MRV2_COORDINATOR_ADDRESS,
    # $MRV2_PROCESS_ID, then JAX's own cluster detection for the address and id. After the
    # config is built: the process count (1: one process) and this process's id.
    num_processes: int | None = None
    coordinator_address: str | None = None  # "host:port" of process 0
    process_id: int | None = None

    def __post_init__(self):
        self.runner = (self.runner or envs.read("MRV2_RUNNER")).lower()
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.tokenizer is not None and not has_tokenizer(self.tokenizer):
            raise ValueError(f"tokenizer {self.tokenizer!r} holds no Hugging Face tokenizer (no tokenizer_config.json)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        # The model and sampler modules load JAX: imported here, where an engine is being configured.
        from mrv2_jax.models.loader import resolve_dtype
        from mrv2_jax.sample.features import variants_by_name

        resolve_dtype(self.dtype)
        if self.sampler_variants is not None:
            variants_by_name(self.sampler_variants)  # a bad list fails here, not at compile time
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        kernels = KernelConfig.parse(self.kernels)
        if self.compile_mode not in (None, *COMPILE_MODES):
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
        if self.bucket_token_sizes is not None:
            self.bucket_token_sizes = check_token_sizes(self.bucket_token_sizes, self.max_num_batched_tokens)
        if self.layer_unroll < 0:
            raise ValueError(f"layer_unroll must be >= 0 (0: unroll every layer), got {self.layer_unroll}")
        unrolled = self.unrolled_layers_max_tokens
        if unrolled is not None and (not isinstance(unrolled, int) or unrolled < 0):
            raise ValueError(f"unrolled_layers_max_tokens must be an int >= 0, got {unrolled!r}")
        if self.runner == "v1" and self.unrolled_layers_max_tokens:
            raise ValueError("unrolled_layers_max_tokens needs the v2 runner")
        rows = self.unrolled_layers_max_rows
        if rows is not None and (not isinstance(rows, int) or rows < 1):
            raise ValueError(f"unrolled_layers_max_rows must be an int >= 1, got {rows!r}")
        if self.runner == "v1" and rows is not None:
            raise ValueError("unrolled_layers_max_rows needs the v2 runner")
        if self.max_fused_steps is None:
            # Fused decode runs K plain decode steps per call with no draft verification, so
            # speculative decoding turns it off (docs/architecture.md, "Speculative decoding").
            on = self.runner == "v2" and self.speculative_config is None
            self.max_fused_steps = DEFAULT_MAX_FUSED_STEPS if on else 1
        for name in ("max_fused_steps", "fused_unroll", "max_fused_rows", "stream_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.runner == "v1" and self.max_fused_steps > 1:
            raise ValueError("fused decode (max_fused_steps > 1) needs the v2 runner")
        if not isinstance(self.stream_in_call, bool):
            raise ValueError(f"stream_in_call must be a bool, got {self.stream_in_call!r}")
        if not isinstance(self.step_twins, bool):
            raise ValueError(f"step_twins must be a bool, got {self.step_twins!r}")
        if self.step_twins and (self.runner != "v2" or self.tensor_parallel_size > 1
                                or self.pipeline_parallel_size != 1):
            raise ValueError(f"step_twins needs the v2 runner on one device, got runner={self.runner!r}, "
                             f"tensor_parallel_size={self.tensor_parallel_size}, "
                             f"pipeline_parallel_size={self.pipeline_parallel_size}")
        if self.stream_in_call and self.tensor_parallel_size > 1:
            raise ValueError("stream_in_call cannot run with tensor parallelism yet (tensor_parallel_size > 1)")
        self._check_tensor_parallel()
        self._check_pipeline_parallel()
        if self.speculative_config is not None and self.max_fused_steps > 1:
            raise ValueError(
                f"max_fused_steps={self.max_fused_steps} with speculative_config: speculative decoding "
                "and fused decode do not run together; leave max_fused_steps unset or set it to 1"
            )
        self._start_processes()  # after every check (the others wait for this process), before JAX's backend
        # Before JAX's backend too, which resolving the kernels starts.
        prefer_vmm_allocator(self.tensor_parallel_size * self.pipeline_parallel_size)
        self.kernels = kernels.resolved()

    def _start_processes(self) -> None:
        self.num_processes = distributed.requested_processes(self.num_processes)
        if self.num_processes > 1:
            self.coordinator_address = self.coordinator_address or envs.read("MRV2_COORDINATOR_ADDRESS")
            if self.process_id is None:
                self.process_id = envs.read("MRV2_PROCESS_ID")
        distributed.check(self.num_processes, self.coordinator_address, self.process_id, self.tensor_parallel_size)
        if self.num_processes > 1:
            self.process_id = distributed.start(self.num_processes, self.coordinator_address, self.process_id)

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism does not cover yet, refused here (the model's own limits, such
        as heads that N does not divide or MoE layers, when it is loaded)."""
        n = self.tensor_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {n!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")
        if self.enable_expert_parallel and n == 1:
            raise ValueError("enable_expert_parallel needs tensor_parallel_size > 1 (the experts are split over "
                             "those devices)")
        if n == 1:
            return
        flag = f"tensor_parallel_size={n}" + (" with enable_expert_parallel" if self.enable_expert_parallel else "")
        if self.runner != "v2":
            raise ValueError(f"{flag} needs the v2 runner, got runner={self.runner!r}")
        if self.speculative_config is not None:
            raise ValueError(f"{flag} with speculative_config: speculative decoding is not "
                             "supported with tensor parallelism yet")

    def _check_pipeline_parallel(self) -> None:
        """What pipeline parallelism does not cover yet, refused here (the model's own limits, such
        as a layer count that N does not divide, when it is loaded)."""
        n = self.pipeline_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"pipeline_parallel_size must be an int >= 1, got {n!r}")
        if n == 1:
            return
        flag = f"pipeline_parallel_size={n}"
        if self.tensor_parallel_size > 1:
            raise ValueError(f"{flag} with tensor_parallel_size={self.tensor_parallel_size}: combining them is not "
                             "supported yet")
        if self.speculative_config is not None:
            raise ValueError(f"{flag} with speculative_config: speculative decoding is not supported with pipeline "
                             "parallelism yet")
        if self.stream_in_call:
            raise ValueError(f"{flag}: stream_in_call cannot run with pipeline parallelism yet")
        if self.program_store:
            raise ValueError(f"{flag} with program_store: the program store keeps programs of one device")
        processes = distributed.requested_processes(self.num_processes)
        if isinstance(processes, int) and processes > 1:
            raise ValueError(f"{flag} over several processes is not supported yet (num_processes > 1)")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
