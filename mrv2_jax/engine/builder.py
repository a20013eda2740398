"""Assembling an engine from its configuration (engine/engine_config.py): model, tokenizer, KV
cache, scheduler, runner."""

import dataclasses
import functools
import hashlib
from pathlib import Path

from mrv2_jax import envs
from mrv2_jax.config import CacheConfig, KernelConfig, SchedulerConfig
from mrv2_jax.engine import compilation_cache
from mrv2_jax.engine.engine_config import DEFAULT_UNROLLED_LAYERS_MAX_TOKENS, EngineConfig
from mrv2_jax.engine.engine_core import EngineCore
from mrv2_jax.engine.scheduler import Scheduler
from mrv2_jax.engine.startup import StartupReport
from mrv2_jax.engine.tokenizer import has_tokenizer, load_tokenizer
from mrv2_jax.models.config_cache import load_hf_config_cached
from mrv2_jax.models.loader import load_hf_config, load_model, resolve_dtype, resolve_model_path
from mrv2_jax.runner.interface import Runner
from mrv2_jax.runner.kv_cache import num_blocks_for_budget
from mrv2_jax.sample.features import SamplerKernels, default_variant_names, variants_by_name
from mrv2_jax.structured.compiler import ConstraintCompiler


def load_draft_model(config: EngineConfig):
    """The draft model's `load_model` result when speculating with one, else None. Loaded before
    the KV cache is sized: its weights, and a KV cache of its own with as many blocks as the
    target's, come out of the same memory budget."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    return load_model(spec.model, config.dtype, spec.load_format)


def make_spec_decoder(config: EngineConfig, model_state, lm, num_blocks: int, max_model_len: int, draft_model=None):
    if config.speculative_config is None:
        return None
    from mrv2_jax.spec_decode.factory import build_spec_decoder

    return build_spec_decoder(config.speculative_config, model_state, lm, num_blocks=num_blocks,
                              block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                              max_model_len=max_model_len, kv_dtype=resolve_dtype(config.dtype), dtype=config.dtype,
                              use_kernels=config.kernels.attention == "pallas", draft_model=draft_model)


def sampler_kernels(kernels: KernelConfig) -> SamplerKernels:
    """The sampler's part of a resolved KernelConfig."""
    return SamplerKernels(logit_stats=kernels.sampler_logit_stats, noise_pass=kernels.sampler_noise_pass,
                          slow_path=kernels.sampler_slow_path)


def resolve_compile_mode(mode: str | None) -> str:
    """EngineConfig.compile_mode for this backend: lazy on CPUs, background elsewhere, unless set."""
    if mode is not None:
        return mode
    import jax

    return "lazy" if jax.default_backend() == "cpu" else "background"


def resolve_unrolled_layers_max_tokens(config: EngineConfig) -> int:
    """EngineConfig.unrolled_layers_max_tokens, unless set: on for the configuration it was measured
    in (one GPU, the v2 runner, no speculative decoding), off elsewhere."""
    if config.unrolled_layers_max_tokens is not None:
        return config.unrolled_layers_max_tokens
    import jax

    measured = (config.runner == "v2" and config.speculative_config is None and config.tensor_parallel_size == 1
                and config.pipeline_parallel_size == 1 and jax.default_backend() == "gpu")
    return DEFAULT_UNROLLED_LAYERS_MAX_TOKENS if measured else 0


def warms_up(config: EngineConfig) -> bool:
    """Whether the engine runs its ready step programs once before serving: on GPUs, where a
    program's first run records its command buffers (CUDA graphs: slow for a program with unrolled
    layers), with compile mode eager (every program) or background (those loaded from the store)."""
    import jax

    return resolve_compile_mode(config.compile_mode) in ("eager", "background") and jax.default_backend() == "gpu"


def make_runner(config: EngineConfig, model_state, lm, num_blocks: int, max_model_len: int,
                spec_decoder=None, tensor_parallel=None, program_store=None) -> Runner:
    variants = variants_by_name(config.sampler_variants or default_variant_names(), sampler_kernels(config.kernels),
                                truncation=config.kernels.sampler_truncation)
    kwargs = dict(num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                  sampler_variants=variants, use_kernels=config.kernels.attention == "pallas",
                  max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                  kv_dtype=resolve_dtype(config.dtype), show_progress=config.show_progress,
                  spec_decoder=spec_decoder, compile_mode=resolve_compile_mode(config.compile_mode),
                  program_store=program_store, bucket_token_sizes=config.bucket_token_sizes,
                  ragged_attention=config.kernels.ragged_attention)
    if config.runner == "v2":
        from mrv2_jax.runner.v2 import ModelRunnerV2

        return ModelRunnerV2(model_state, lm, max_fused_steps=config.max_fused_steps, tensor_parallel=tensor_parallel,
                             fused_unroll=config.fused_unroll, max_fused_rows=config.max_fused_rows,
                             unrolled_layers_max_tokens=resolve_unrolled_layers_max_tokens(config),
                             unrolled_layers_max_rows=config.unrolled_layers_max_rows,
                             decode_attention=config.kernels.decode_attention,
                             decode_projections=config.kernels.decode_projections,
                             stream_in_call=config.stream_in_call and config.max_fused_steps > 1,
                             step_twins=config.step_twins, **kwargs)
    from mrv2_jax.runner.v1 import ModelRunnerV1

    return ModelRunnerV1(model_state, lm, tensor_parallel=tensor_parallel, **kwargs)


def make_program_store(config: EngineConfig, model_path: Path, num_blocks: int, max_model_len: int):
    """The runner's ProgramStore (runner/program_store.py), or None: off unless set, or by default on a
    GPU with one device and the compilation cache on; keyed by the engine's configuration, the
    model's config file and the KV cache's size."""
    import jax

    root = cache_root()
    wanted = (jax.default_backend() == "gpu" and config.tensor_parallel_size == config.pipeline_parallel_size == 1
              if config.program_store is None else config.program_store)
    if not wanted or root is None:
        return None
    from mrv2_jax.runner.program_store import ProgramStore, fingerprint

    config_file = model_path / "config.json"
    model_config = config_file.read_bytes() if config_file.is_file() else str(model_path).encode()
    # Fields that change no program's trace stay out of the key (a lazy engine finds an eager one's).
    same_programs = dataclasses.replace(config, compile_mode=None, program_store=None, show_progress=True)
    key = fingerprint(same_programs, hashlib.sha256(model_config).hexdigest(), num_blocks, max_model_len)
    return ProgramStore(root / "programs", key)


def config_cache_dir() -> Path | None:
    """Where model configs are kept for warm starts (models/config_cache.py): beside the compiled
    programs, and off with them."""
    root = cache_root()
    return None if root is None else root / "hf_configs"


def cache_root() -> Path | None:
    """MRV2_COMPILATION_CACHE as a folder, or None when it is off."""
    where = envs.read("MRV2_COMPILATION_CACHE")
    return None if where.lower() == "off" else Path(where).expanduser()


def use_moe_backend(model_state, kernels: KernelConfig) -> None:
    """Set the MoE experts' grouped GEMM on a model state that has experts (read when traced)."""
    if hasattr(model_state, "moe_backend"):
        model_state.moe_backend = kernels.moe_backend


def make_tensor_parallel(size: int, model_state, lm, expert_parallel: bool = False):
    """None for one device; else the mesh of `size` devices (runner/tensor_parallel.py) with `lm`'s layers
    split over it (the family's rules, checked first: ValueError naming the flag), its experts
    too with `expert_parallel`. Weights a previous engine split already (`build_engine`'s
    `loaded_model`) are reused as they are."""
    if model_state.tp_size not in (1, size):
        raise ValueError(f"tensor_parallel_size={size}: the loaded weights are split for "
                         f"{model_state.tp_size} devices already; load the model again")
    if model_state.tp_size > 1 and (model_state.expert_mesh is not None) != expert_parallel:
        raise ValueError(f"enable_expert_parallel={expert_parallel}: the loaded weights were split "
                         f"{'with' if model_state.expert_mesh is not None else 'without'} it; load the model again")
    if size == 1:
        return None
    from mrv2_jax.runner.tensor_parallel import TensorParallel

    model_state.check_tensor_parallel(size, expert_parallel)  # the model's limits before the devices'
    tensor_parallel = TensorParallel(size, expert_parallel)
    if model_state.tp_size == 1:
        tensor_parallel.shard_model(model_state, lm)
    return tensor_parallel


def make_pipeline_parallel(size: int, model_state, lm):
    """None for one device; else the stages' mesh of `size` devices (runner/pipeline_parallel.py) with
    `lm`'s layers split over it (the model's limits checked first: ValueError naming the flag)."""
    if lm.pipeline_mesh is not None:  # `build_engine`'s `loaded_model`, split by an earlier engine
        raise ValueError(f"pipeline_parallel_size={size}: the loaded weights are split into stages already; "
                         "load the model again")
    if size == 1:
        return None
    from mrv2_jax.runner.pipeline_parallel import PipelineParallel

    model_state.check_pipeline_parallel(size)  # the model's limits before the devices'
    pipeline = PipelineParallel(size)
    pipeline.shard_model(model_state, lm)
    return pipeline


def build_engine(config: EngineConfig, loaded_model=None):
    """-> (EngineCore, tokenizer path or None, model_state); the engine's `startup` says where the
    time went. The engine loads the tokenizer only when a structured-output request first needs it.
    `loaded_model`: a `load_model` result to reuse (benchmarks that build several engines over one
    set of weights)."""
    report = StartupReport()
    model_path = resolve_model_path(config.model) if loaded_model is None else loaded_model[2]
    tokenizer_path = Path(config.tokenizer) if config.tokenizer else model_path
    tokenizer_path = tokenizer_path if has_tokenizer(tokenizer_path) else None
    with report.phase("backend"):  # the cache's settings ask for the backend, which starts it
        import jax

        compilation_cache.enable()
        jax.devices()
    hf_config = None
    if loaded_model is None:
        with report.phase("model config"):
            hf_config = load_hf_config_cached(model_path, config_cache_dir(), load_hf_config)
    with report.phase("weights"):
        model_state, lm, _ = loaded_model or load_model(config.model, config.dtype, config.load_format, config.seed,
                                                           hf_config=hf_config)
    lm.layer_unroll = config.layer_unroll or True  # read when the steps are traced
    use_moe_backend(model_state, config.kernels)
    # The runner takes either kind of mesh as its `tensor_parallel` (the same interface); the config
    # allows at most one of them.
    tensor_parallel = make_tensor_parallel(config.tensor_parallel_size, model_state, lm, config.enable_expert_parallel)
    tensor_parallel = tensor_parallel or make_pipeline_parallel(config.pipeline_parallel_size, model_state, lm)
    max_model_len = config.max_model_len or model_state.max_model_len
    if max_model_len > model_state.max_model_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {model_state.max_model_len}")
    kv_dtype = resolve_dtype(config.dtype)
    from mrv2_jax.spec_decode.factory import proposer_kv_bytes_per_token

    with report.phase("weights"):
        draft_model = load_draft_model(config)
    if draft_model is not None:
        use_moe_backend(draft_model[0], config.kernels)
    proposer_kv_bytes = proposer_kv_bytes_per_token(config.speculative_config, model_state,
                                                    draft_model and draft_model[0], kv_dtype)
    num_blocks = config.num_gpu_blocks or num_blocks_for_budget(
        model_state, config.block_size, kv_dtype, config.gpu_memory_utilization,
        extra_kv_bytes_per_token=proposer_kv_bytes,
        kv_shards=config.tensor_parallel_size * config.pipeline_parallel_size)
    if tensor_parallel is not None and not config.num_gpu_blocks:
        num_blocks = tensor_parallel.smallest(num_blocks)  # one cache size for every process
    with report.phase("runner (KV cache, tables, compile)"):
        spec_decoder = make_spec_decoder(config, model_state, lm, num_blocks, max_model_len, draft_model)
        store = make_program_store(config, model_path, num_blocks, max_model_len)
        runner = make_runner(config, model_state, lm, num_blocks, max_model_len, spec_decoder, tensor_parallel,
                             store)
    if warms_up(config):
        with report.phase("warm-up (every program run once)"):
            runner.warm_up()
    async_scheduling = runner.is_async_capable if config.async_scheduling is None else config.async_scheduling
    fused_rows = runner.max_fused_rows  # the largest batch the runner can fuse
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                        max_model_len=max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
                        async_scheduling=async_scheduling,
                        num_speculative_tokens=spec_decoder.k if spec_decoder else 0,
                        num_lookahead_tokens=spec_decoder.num_lookahead_tokens if spec_decoder else 0,
                        max_fused_steps=config.max_fused_steps if fused_rows else 1, max_fused_rows=fused_rows,
                        stream_interval=config.stream_interval,
                        max_tokens_while_decoding=config.max_tokens_while_decoding),
        CacheConfig(block_size=config.block_size, num_gpu_blocks=num_blocks,
                    gpu_memory_utilization=config.gpu_memory_utilization,
                    enable_prefix_caching=config.enable_prefix_caching),
        eos_token_id=model_state.eos_token_ids, automaton_pool=runner.automaton_pool)
    compiler = None if tokenizer_path is None else ConstraintCompiler(
        None, model_state.eos_token_ids or (), model_state.vocab_size,
        load_tokenizer=functools.partial(load_tokenizer, tokenizer_path))
    engine = EngineCore(scheduler, runner, async_scheduling, compiler)
    report.from_program_store = store.loaded if store is not None else 0
    engine.startup = report.finish()
    return engine, tokenizer_path, model_state
