"""What ModelRunnerV1 and ModelRunnerV2 share: the model, the KV cache, the sampler tables,
the buckets, and compiling every bucket's step ahead of time.

The two differ in where the batch's inputs are built (V1: numpy on the host, V2: from
persistent device tables), so each keeps its own step function, packed layout and `execute`.
"""

import math
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.config import MAX_LOGIT_BIAS, MAX_STOP_IDS
from mrv2_jax.runner.buckets import Bucket, BucketPlan
from mrv2_jax.runner.kv_cache import allocate_kv_cache
from mrv2_jax.runner.lazy_programs import BackgroundCompile, LazyPrograms
from mrv2_jax.runner.model_step import FlatParams
from mrv2_jax.runner.precompile import compile_all, compile_workers
from mrv2_jax.runner.scheduler_output import NewRequestData
from mrv2_jax.runner.slots import SlotAllocator
from mrv2_jax.sample import slot_state
from mrv2_jax.sample.features import SamplerFeatures
from mrv2_jax.sample.tensors import SamplingRow, sampling_row
from mrv2_jax.xla_flags import step_compiler_options


def reading_slot_tables(step):
    """`step(param_leaves, *state, sampler_state, packed, spec_params, spec_state)` as the program
    `_compile_steps` compiles: the SlotState comes in split (counts, tables) and only its counts go
    back out, the tables being read only."""
    def program(param_leaves, *args):
        *carried, counts, tables, packed, spec_params, spec_state = args
        *carried, sampler_state, out, spec_state = step(param_leaves, *carried, slot_state.join(counts, tables),
                                                        packed, spec_params, spec_state)
        new_counts, new_tables = slot_state.split(sampler_state)
        if any(a is not b for a, b in zip(jax.tree.leaves(new_tables), jax.tree.leaves(tables), strict=True)):
            raise ValueError("a step program changed the SlotState's tables, which steps take read only; "
                             "write them with their own program (sample/slot_state.py)")
        return *carried, new_counts, out, spec_state

    return program


def donated_arguments(num_carried: int) -> tuple[int, ...]:
    """The argument indices a step program donates, in its argument order (param_leaves, *carried,
    counts, tables, packed, spec_params, spec_state): the carried state, the counts, the spec state."""
    return (*range(1, 2 + num_carried), num_carried + 5)


def returning_its_input(program):
    """`program` that also returns its packed input, as a device array (the last output): a decoding
    batch sends the same packed input step after step, and the V2 runner passes that array back
    while the bytes repeat (`ModelRunnerV2._dispatch`), which spares a call the host-to-device copy
    of a fresh host buffer and keeps the argument's address for XLA's recorded command buffers."""
    def program_and_input(param_leaves, *args):
        packed = args[-3]  # (*carried, counts, tables, packed, spec_params, spec_state)
        return *program(param_leaves, *args), packed

    return program_and_input


class RunnerBase:
    """Shared state of both runners; each subclass adds its own tables, then compiles."""

    max_fused_rows = 0  # V2 sets its own when it compiles fused decode
    num_fused_calls = 0
    _none_pending = False  # num_programs_pending reached 0
    stream_in_call = False  # V2 may stream fused steps' tokens (runner/fused.py)
    token_sink = None
    call_seconds = 0.0  # host seconds in compiled step calls so far (runner/interface.py)
    # Whether the step programs also return their packed input (`returning_its_input`; V2 reuses it),
    # and the last call's, as that device array.
    returns_its_input = False
    last_input = None
    step_twins = None  # V2 may call each program in turn with a twin (runner/step_twins.py)
    automaton_capacity = (0, 0)  # V2 runs structured outputs (runner/interface.py)
    automaton_pool = None
    # Packed fields in which -1 means "none" (every other field is empty at 0); each runner names its own.
    _none_fields: tuple[str, ...] = ()

    def __init__(self, model_state, lm, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype=jnp.bfloat16,
                 use_kernels: bool | None = None, sampler_variants: tuple[SamplerFeatures, ...] | None = None,
                 spec_decoder=None, automaton_pool: tuple[int, int] = (1, 1), compile_mode: str = "eager",
                 tensor_parallel=None, extra_buckets: tuple[Bucket, ...] = (), program_store=None,
                 bucket_token_sizes: tuple[int, ...] | None = None, ragged_attention: str = "pallas"):
        """`use_kernels`: Pallas attention (default: on GPUs); `ragged_attention`: its kernel, "pallas" or
        "mgpu" (KernelConfig.ragged_attention). `sampler_variants`: the sampler
        feature sets compiled per bucket, cheapest first, each covering the ones before it; the
        last must cover everything (default: SamplerFeatures.default_variants()).
        `spec_decoder`: a spec_decode.decoder.SpecDecoder, or None. `automaton_pool`: (states,
        exception entries) of the device's structured-output pool (sample/automata.py).
        `compile_mode`: when the step programs compile: "eager" (all at start-up), "lazy" (each at
        its first use) or "background" (on threads beside the engine, and at first use if that
        comes sooner: runner/lazy_programs.py). `tensor_parallel`: a runner.tensor_parallel.
        TensorParallel whose mesh `lm` is already split over (the builder did it), or None.
        `extra_buckets`: buckets besides the plan's own, `bucket_token_sizes`: the plan's token
        counts (None: powers of two; runner/buckets.py). `program_store`: a
        runner.program_store.ProgramStore that compiled step programs are loaded from and saved to
        (one device only), or None."""
        if program_store is not None and tensor_parallel is not None:
            raise ValueError("a program store keeps programs of one device; not with tensor parallelism")
        self.program_store = program_store
        self.tp = tensor_parallel
        self.params = FlatParams(lm)
        self.compile_mode = compile_mode
        self.background_compile = None  # a BackgroundCompile while compile_mode is "background"
        self.block_size = block_size
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.use_kernels = jax.default_backend() == "gpu" if use_kernels is None else use_kernels
        self.ragged_attention = ragged_attention
        self.kv_cache = allocate_kv_cache(model_state, num_blocks, block_size, kv_dtype, tensor_parallel)
        self.spec = spec_decoder
        self.spec_params = spec_decoder.init_params() if spec_decoder else ()
        self.spec_state = spec_decoder.init_state() if spec_decoder else ()
        self.buckets = BucketPlan(max_num_batched_tokens, max_num_seqs,
                                  decode_width=1 + (spec_decoder.k if spec_decoder else 0), extra=extra_buckets,
                                  sizes=bucket_token_sizes)
        self.slots = SlotAllocator(max_num_seqs)
        self.sampler_variants = tuple(sampler_variants or SamplerFeatures.default_variants())
        self.vocab_size = model_state.vocab_size
        self.eos_token_ids = tuple(model_state.eos_token_ids or ())
        # Seeds for requests that give none; across processes from one seed all of them share.
        self._seed_rng = np.random.default_rng(None if self.tp is None else self.tp.shared_seed())
        # Persistent device tables: penalty counts / prompt masks, bias and stop lists per slot,
        # written once when a request arrives (only if it uses them).
        self.slot_state = slot_state.init_slot_state(max_num_seqs, self.vocab_size, MAX_LOGIT_BIAS, MAX_STOP_IDS,
                                                     max_model_len, automaton_pool)
        if self.tp is not None:  # on every device before the writers compile for it
            self.slot_state = self.tp.replicate(self.slot_state)
        self._slot_writer = slot_state.SlotStateWriter(self.slot_state)

    @property
    def supports_prompt_logprobs(self) -> bool:
        """Prompt logprobs come from the full variant's plain step (not a spec step)."""
        return self.spec is None and self.sampler_variants[-1].prompt_logprobs

    def _new_sampling_row(self, new: NewRequestData, slot: int) -> tuple[SamplingRow, bool]:
        """A new request's sampler values, with its per-slot device rows written if it needs them
        -> (its SamplingRow, whether slot's device rows now hold this request's data)."""
        row = sampling_row(new.sampling_params, eos_token_ids=self.eos_token_ids, seed_rng=self._seed_rng)
        self.slot_state, owns_rows = self._slot_writer.write(
            self.slot_state, slot, row, new.token_ids, new.num_prompt_tokens)
        return row, owns_rows

    def _compile_steps(self, steps: dict, device_state: tuple, show_progress: bool) -> dict:
        """Every step program, one per bucket and sampler variant, compiled ahead of time (or, with
        `compile_mode` lazy or background, at its first use or beside the engine:
        runner/lazy_programs.py), so a step outside them is an error, never a silent recompile.

        `steps`: {key: (PackedLayout, make_fn)}, `make_fn(layout, features)` returning
            fn(param_leaves, *device_state, packed, spec_params, spec_state)
                -> (*device_state, sampler output, spec_state)
        (with `returns_its_input`, the compiled program returns its packed input after these);
        `device_state`: the arrays the step updates (donated, like the spec state), the runner's
        SlotState last. The compiled program takes that SlotState split (`reading_slot_tables`):
        its counts donated, its tables read only.
        -> {key: (layout, the compiled programs of its sampler variants, in order)}."""
        *carried, sampler_state = device_state
        counts, tables = slot_state.split(sampler_state)
        donate = donated_arguments(len(carried))
        options = step_compiler_options(self.params.leaves)
        # Tensor parallelism: the packed input is replicated and every output keeps its place, so
        # that the donated state comes back where the next call expects it.
        packed_sharding, out = self.tp.step_shardings((*carried, counts)) if self.tp else (None, None)
        if out is not None and self.returns_its_input:
            out = (*out, packed_sharding)
        sharded = {} if self.tp is None else {"out_shardings": out}

        def lower(layout, make_fn, i):
            packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=packed_sharding)
            program = reading_slot_tables(make_fn(layout, self.sampler_variants[i]))
            if self.returns_its_input:
                program = returning_its_input(program)
            return jax.jit(program, donate_argnums=donate, **sharded).lower(
                self.params.leaves, *carried, counts, tables, packed, self.spec_params, self.spec_state)

        num_variants = len(self.sampler_variants)
        store = self.program_store

        def name(key, i):  # a program's name in the store: its step key and variant
            return f"{key!r}/{i}"

        if self.compile_mode in ("lazy", "background"):
            def make(key, layout, make_fn):
                saved = None if store is None else (lambda i: store.load(name(key, i)),
                                                    lambda i, lowered: store.compile(name(key, i), lowered, options))
                return LazyPrograms(lambda i: lower(layout, make_fn, i), num_variants,
                                    compile=lambda lowered: lowered.compile(options or None), store=saved)

            programs = {key: (layout, make(key, layout, make_fn)) for key, (layout, make_fn) in steps.items()}
            if self.compile_mode == "background":
                # Every bucket's cheapest variant first, in bucket order, then the next variant; what
                # the store holds is loaded now (on the compile threads), the rest compiles beside the engine.
                todo = [(lazy, i) for i in range(num_variants) for _, lazy in programs.values()]
                if store is not None:
                    with ThreadPoolExecutor(compile_workers()) as pool:
                        loaded = list(pool.map(lambda item: item[0].load_stored(item[1]), todo))
                    todo = [item for item, ready in zip(todo, loaded) if not ready]
                self.background_compile = BackgroundCompile(todo, compile_workers())
        else:
            wanted = [(key, i) for key in steps for i in range(num_variants)]
            compiled = {}
            if store is not None:  # on the compile threads: several at once on GPUs
                with ThreadPoolExecutor(compile_workers()) as pool:
                    compiled = dict(zip(wanted, pool.map(lambda k: store.load(name(*k)), wanted)))
            missing = [k for k in wanted if compiled.get(k) is None]
            lowered = {(key, i): lower(*steps[key], i) for key, i in missing}
            compile_one = None if store is None else (lambda k, low: store.compile(name(*k), low, options))
            compiled |= compile_all(lowered, show_progress, compiler_options=options,
                                    compile_one=compile_one) if lowered else {}
            programs = {key: (layout, [compiled[key, i] for i in range(num_variants)])
                        for key, (layout, _) in steps.items()}
        self._step_programs = programs  # what warm_up runs
        return programs

    def call_step(self, compiled, packed):
        """Run one compiled step on the runner's state, which the call donates and replaces;
        -> the step's device result."""
        raise NotImplementedError

    def _call_program(self, compiled, carried: tuple, packed) -> tuple:
        """One call of a program `_compile_steps` compiled, in its argument order: `carried` (the
        device state before the SlotState) donated, the SlotState split, the spec state donated. Sets the
        new SlotState and spec state -> (the new `carried`, the step's device result)."""
        counts, tables = slot_state.split(self.slot_state)
        start = time.perf_counter()
        outputs = compiled(self.params.leaves, *carried, counts, tables, packed, self.spec_params, self.spec_state)
        self.call_seconds += time.perf_counter() - start
        if self.returns_its_input:
            *outputs, self.last_input = outputs
        *carried, counts, result, self.spec_state = outputs
        self.slot_state = slot_state.join(counts, tables)
        return carried, result

    def empty_batch(self, layout) -> np.ndarray:
        """A packed step input that holds no request: every row is padding."""
        packed = layout.empty()
        for name in self._none_fields:
            if name in layout.shapes:
                layout.view(packed, name)[...] = -1
        return packed

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        return self.background_compile is None or self.background_compile.wait(timeout)

    @property
    def num_programs_pending(self) -> int:
        if self._none_pending:  # read after every step: once none is left, none will be again
            return 0
        pending = sum(len(variants) - variants.num_compiled for _, variants in self._step_programs.values()
                      if isinstance(variants, LazyPrograms))
        self._none_pending = pending == 0
        return pending

    def warm_up(self) -> None:
        """Run every step program once on an empty batch, so that XLA records each program's command
        buffers (its CUDA graphs) before the first request instead of in it. Compile mode lazy or
        background: only the programs ready now (loaded from the store); the others record theirs at
        first use. Padding rows change no request's state, and the KV they may write belongs to no
        request yet."""
        for layout, variants in self._step_programs.values():
            for compiled in variants.ready() if isinstance(variants, LazyPrograms) else variants:
                if self.step_twins is None:
                    self.call_step(compiled, self.empty_batch(layout))
                else:  # the program, then its twin (loaded now, not at the first request's step)
                    for _ in range(2):
                        self.call_step(self.step_twins.pick(compiled), self.empty_batch(layout))
        jax.block_until_ready(self.kv_cache)
