"""Model Runner V2: persistent device state, input preparation on the device, async-ready.

Per step the host sends ONE packed int32 buffer holding only what changed: the batch order
(`idx_mapping`: batch row -> request slot), tokens per row, new requests' metadata, block-table
appends, and the prompt tokens of the prefill chunks scheduled now. Everything else - input ids
(including the tokens sampled by the previous step, which never visit the host), positions,
slot mapping, sequence lengths, logits indices, the batch's block tables - is built on the
device from the persistent tables, and the sampled tokens are written back there.

`execute` returns as soon as the step is dispatched: the sampled tokens start copying to the
host in the background and are read only when the engine asks for them, one step later with
async scheduling.

Speculative decoding (`spec_decoder`, spec_decode/decoder.py) replaces the sample/post-update
tail of the step: decode rows carry drafts read from the token table, the step verifies them and
writes the next drafts there; the host reads 1..1+k tokens per row, one step later as usual.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax import envs
from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.runner import prepare
from mrv2_jax.runner.automaton_pool import AutomatonPool
from mrv2_jax.runner.base import RunnerBase
from mrv2_jax.runner.buckets import Bucket, few_row_buckets
from mrv2_jax.runner.device_state import MAX_DEVICE_STOP_IDS, SAMPLING_FIELDS, init_device_state
from mrv2_jax.runner.fused import device_stop_ids, fused_layout, make_fused_decode
from mrv2_jax.runner.grammar_masks import GrammarMasks
from mrv2_jax.runner.model_step import forward_and_sample
from mrv2_jax.runner.packed import PackedLayout
from mrv2_jax.runner.scheduler_output import SchedulerOutput
from mrv2_jax.runner.step_result import StepResult, prompt_token_logprobs
from mrv2_jax.runner.step_twins import StepTwins
from mrv2_jax.runner.token_logprobs import LogprobBlock, LogprobRow
from mrv2_jax.sample import slot_state
from mrv2_jax.sample.automata import AutomatonWriter
from mrv2_jax.sample.features import SamplerFeatures
from mrv2_jax.sample.sampler import SamplerOutput
from mrv2_jax.sample.tensors import FLOAT_SCALAR_FIELDS, is_plain_greedy, row_needs

OVERFLOW_CHUNK = 512  # block-table writes per extra dispatch when a step's buffer is too small


_CALL_TAGS = 1 << 30  # a fused call's tag (int32 in the packed input) wraps around
_CALLS_REMEMBERED = 8  # calls whose rows stay known: more than can be in flight at once


class PendingStep:
    """The sampled tokens (and logprobs) of a dispatched step; `result()` blocks until they are
    on the host. Tokens are `[R]` (one step), `[K, R]` (a fused call: -1 where a row sampled
    nothing, so each row's tokens are a prefix of its column) or `[R, 1 + k]` with `num_sampled`
    `[R]` (a speculative step: row r keeps its first num_sampled[r])."""

    def __init__(self, out: SamplerOutput, req_ids: list[str], sampling_req_ids: set[str],
                 logprob_req_ids: dict[str, int], prompt_spans: dict | None = None):
        """`logprob_req_ids`: the rows' requests that asked for logprobs -> their top n."""
        out.tokens.copy_to_host_async()  # start the device->host copy now, read it later
        self._prompt_spans = prompt_spans or {}
        if self._prompt_spans:
            for array in (out.prompt_logprobs, out.prompt_token_ids, out.prompt_rank):
                array.copy_to_host_async()
        # Spec steps (SpecSamplerOutput): tokens [R, 1 + k] and how many of each row to keep.
        self._num_sampled = getattr(out, "num_sampled", None)
        if self._num_sampled is not None:
            self._num_sampled.copy_to_host_async()
        if logprob_req_ids:
            for array in (out.logprobs, out.logprob_token_ids, out.sampled_rank):
                array.copy_to_host_async()
        self._out, self._req_ids, self._sampling, self._logprob_reqs = out, req_ids, sampling_req_ids, logprob_req_ids

    def _tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """-> (tokens [K, R], number of valid tokens per row [R])."""
        tokens = np.asarray(self._out.tokens)
        if self._num_sampled is not None:  # a spec step: [R, 1 + k], each row's count on the side
            return tokens.T, np.asarray(self._num_sampled)
        if tokens.ndim == 1:
            return tokens[None], np.ones(tokens.shape[0], np.int64)
        return tokens, (tokens >= 0).sum(axis=0)

    def result(self) -> dict[str, list[int]]:
        # Python ints and lists throughout: indexing numpy arrays row by row is slow on this path.
        sampling = self._sampling
        tokens = np.asarray(self._out.tokens)
        if tokens.size and tokens.min() <= prepare.DIVERGED:
            self._raise_diverged(tokens)
        if self._num_sampled is None and tokens.ndim == 1:  # one step: one token per row
            if len(sampling) == len(self._req_ids):  # every row samples (decode steps)
                return {r: [t] for r, t in zip(self._req_ids, tokens.tolist())}
            return {r: [t] for r, t in zip(self._req_ids, tokens.tolist()) if r in sampling}
        tokens, counts = self._tokens()
        return {r: column[:n] for r, column, n in zip(self._req_ids, tokens.T.tolist(), counts.tolist())
                if r in sampling}

    def _raise_diverged(self, tokens: np.ndarray):
        rows = np.flatnonzero((tokens.reshape(-1, tokens.shape[-1]) == prepare.DIVERGED).any(axis=0))
        req_ids = [self._req_ids[r] for r in rows]  # padding rows are never flagged
        raise RuntimeError(f"the device's tables of request(s) {req_ids} no longer match their schedule (a decoding "
                           "row whose token count is not one past its computed tokens): a step program lost an "
                           "update, and the tokens would come from wrong inputs (runner/prepare.py, diverged_rows)")

    def prompt_logprobs(self) -> dict[str, tuple[int, list[LogprobRow]]]:
        return prompt_token_logprobs(self._out, self._prompt_spans)

    def logprobs(self) -> dict[str, list[LogprobRow]]:
        """One row reference per kept token, no lists: this runs on the critical path."""
        if not self._logprob_reqs:
            return {}
        counts = self._tokens()[1].tolist()
        block = LogprobBlock.of(self._out.logprobs, self._out.logprob_token_ids, self._out.sampled_rank)
        num_rows = len(counts)  # the block's row of a row's token k: k * num_rows + row (also for one step)
        rows = {}
        for i, r in enumerate(self._req_ids):
            n = self._logprob_reqs.get(r)
            if n is not None:
                rows[r] = ([LogprobRow(block, i, n)] if counts[i] == 1
                           else [LogprobRow(block, k * num_rows + i, n) for k in range(counts[i])])
        return rows


class ModelRunnerV2(RunnerBase):
    is_async_capable = True
    returns_its_input = True  # a decoding batch's repeated input goes from the device (_dispatch)
    _none_fields = ("new_slot", "new_sampler_row", "append_slot")

    @property
    def automaton_capacity(self) -> tuple[int, int]:
        """Constraints are masked and advanced in the step and the fused loop, not in a spec step."""
        pool = self.automaton_pool
        return (0, 0) if self.spec is not None else (pool.num_states, pool.num_exceptions)

    def __init__(self, model_state, lm, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype=jnp.bfloat16,
                 use_kernels: bool | None = None, sampler_variants: tuple[SamplerFeatures, ...] | None = None,
                 show_progress: bool = True, spec_decoder=None, max_fused_steps: int = 1, max_fused_rows: int = 32,
                 fused_unroll: int = 1, compile_mode: str = "eager", tensor_parallel=None,
                 stream_in_call: bool = False, unrolled_layers_max_tokens: int = 0,
                 unrolled_layers_max_rows: int | None = None, program_store=None, decode_attention: str = "pallas",
                 bucket_token_sizes: tuple[int, ...] | None = None, ragged_attention: str = "pallas",
                 decode_projections: str = "xla", step_twins: bool = False):
        """Arguments as RunnerBase's; a step uses the first sampler variant that covers every
        row's needs (prompt logprobs always take the last).
        `max_fused_steps` > 1 also compiles fused decode (runner/fused.py) for the buckets of up
        to `max_fused_rows` rows; it cannot be combined with a spec decoder.
        `stream_in_call`: fused decode hands each step's tokens to `token_sink` (set by the
        server's engine process) during the call; not with tensor parallelism.
        `unrolled_layers_max_tokens`: the step programs and fused decode's programs of buckets with at
        most this many tokens unroll every decoder layer (larger buckets keep the model's loop);
        `unrolled_layers_max_rows` (None: no limit) keeps the loop in buckets of more rows, and adds
        a bucket of that many rows at each of the plan's token counts up to `unrolled_layers_max_tokens`
        whose own bucket has more rows, so that a step with few rows and a prompt still gets an
        unrolled program while a full decode batch keeps the loop.
        `tensor_parallel` (runner/tensor_parallel.py): the mesh the layers and KV heads are split
        over; the device state is replicated on it; not with a spec decoder. `decode_attention`: the
        attention kernel of fused decode, "pallas" or "mgpu" (KernelConfig.decode_attention);
        `ragged_attention` that of every other step (KernelConfig.ragged_attention), whose one-token
        rows take `decode_attention`'s where it is "mgpu". `decode_projections`: "gemv" runs the
        projections of fused decode's one-row bucket as the GEMV kernels, one token (the family's
        `gemv_weights`; models/gemv_projections.py), and adds a one-token, one-row bucket whose step
        program runs them too (a lone decode row without fused decode, e.g. one stream); "xla" leaves
        them to cuBLAS and pads that bucket to fused.ONE_ROW_TOKENS. Buckets of more rows keep cuBLAS.
        One device, no speculative decoding. `step_twins`: each program's calls alternate between it
        and a second loaded copy (runner/step_twins.py); one GPU only."""
        if spec_decoder is not None and tensor_parallel is not None:
            raise ValueError("tensor parallelism cannot run with speculative decoding yet")
        if spec_decoder is not None and max_fused_steps > 1:
            raise ValueError("fused decode (max_fused_steps > 1) cannot run with speculative decoding")
        if stream_in_call and tensor_parallel is not None:
            raise ValueError("stream_in_call cannot run with tensor parallelism yet")
        if step_twins and (jax.default_backend() != "gpu" or tensor_parallel is not None):
            raise ValueError(f"step_twins needs one GPU (backend {jax.default_backend()!r}, tensor parallelism "
                             f"{'on' if tensor_parallel is not None else 'off'}): the twins are the step programs "
                             "serialized and loaded again, which XLA:CPU cannot do")
        self.step_twins = StepTwins() if step_twins else None
        pool = (envs.read("MRV2_STRUCTURED_STATES"), envs.read("MRV2_STRUCTURED_EXCEPTIONS"))
        tokens, max_rows = min(unrolled_layers_max_tokens, max_num_batched_tokens), unrolled_layers_max_rows
        # Buckets besides the plan's: unrolled ones of few rows, and the GEMV path's one-token bucket.
        extra = () if not tokens or max_rows is None else few_row_buckets(
            max_num_batched_tokens, max_num_seqs, tokens, max_rows, bucket_token_sizes)
        # Whether one-row programs run their projections as the GEMV kernel (CausalLM.gemv_projections):
        # fused decode's one-row bucket, and the step program of a one-token bucket added for it.
        self.gemv_one_row = (decode_projections == "gemv" and tensor_parallel is None and spec_decoder is None
                             and lm.pipeline_mesh is None and bool(model_state.gemv_weights))
        if self.gemv_one_row:
            extra += (Bucket(1, 1),)
        super().__init__(model_state, lm, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                         kv_dtype=kv_dtype, use_kernels=use_kernels, sampler_variants=sampler_variants,
                         spec_decoder=spec_decoder, automaton_pool=pool,
                         compile_mode=compile_mode, tensor_parallel=tensor_parallel, extra_buckets=extra,
                         program_store=program_store, bucket_token_sizes=bucket_token_sizes,
                         ragged_attention=ragged_attention)
        # Structured outputs: the automata in the device pool, the writer that copies one in, and
        # the token a row whose state allows nothing gets (sample/automata.py).
        self.automaton_pool = AutomatonPool(*pool)
        self._automaton_writer = AutomatonWriter(self.slot_state.automata)
        # Grammars: the host's bitmask into each grammar request's pool state before its steps.
        self.grammar_masks = GrammarMasks(self.slot_state.automata, eager=compile_mode == "eager")
        self.eos_for_masks = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.state = init_device_state(max_num_seqs, max_model_len, self.max_blocks_per_seq)
        if self.tp is not None:
            self.state = self.tp.replicate(self.state)
        # Rows still prefilling: the host copy of their tokens, and the position of the next chunk
        # (the runner counts the chunks itself; the scheduler lists a running request only when it
        # gets new blocks).
        self._prompts: dict[str, tuple[list[int], int]] = {}
        self._num_blocks: dict[str, int] = {}  # blocks sent so far, per request
        self._logprob_reqs: dict[str, int] = {}  # requests that asked for logprobs -> top n
        self._prompt_lp_reqs: dict[str, tuple[int, int]] = {}  # prompt_logprobs -> (top n, prompt length)
        # Plain-greedy batches take an argmax-only sampler, batches that only sample with a
        # temperature a variant without conditionals, any other batch the variant with every
        # feature behind runtime skips (sample/features.py says what each costs).
        self._variant_of: dict[str, int] = {}  # live requests that need more than variant 0
        # Fused decode takes one token per row and step: per row count up to max_fused_rows, the
        # smallest bucket with that many rows.
        self.max_fused_steps = max_fused_steps
        self.fused_unroll = fused_unroll
        self.decode_attention = decode_attention
        self.unrolled_layers_max_tokens = unrolled_layers_max_tokens
        self.unrolled_layers_max_rows = unrolled_layers_max_rows
        by_rows = {}
        for b in self.buckets:
            if max_fused_steps > 1 and b.num_reqs <= max_fused_rows:
                by_rows.setdefault(b.num_reqs, b)
        self.fused_buckets = tuple(by_rows.values())
        self.max_fused_rows = max(by_rows, default=0)
        self.num_fused_calls = 0
        # Streaming in the call: `token_sink(entries)` gets (req_id, output index, token) for
        # each row of each fused step; the rows' request ids per call, by the call's tag.
        self.stream_in_call = stream_in_call
        self.token_sink = None
        self._fused_rows: dict[int, list[str]] = {}
        # The bytes of the packed input that `last_input` holds on the device, while they repeat
        # (one process only: several keep their own copies of the input).
        self._repeated_input: tuple[bytes, jax.Array] | None = None
        self.hooks = None  # benchmarks' instrumentation (runner/step_hooks.py); None: nothing is called
        self._compile_all(show_progress)

    # --- compilation ---------------------------------------------------------------------
    def _layout(self, bucket: Bucket) -> PackedLayout:
        t, r = bucket.num_tokens, bucket.num_reqs
        # Block appends: a step adds at most t / block_size + 1 blocks per row in steady state;
        # a larger burst (a long prefix-cache hit) takes an extra small dispatch.
        max_appends = t // self.block_size + 2 * r
        return PackedLayout(
            {"idx_mapping": (r,), "num_scheduled": (r,), "num_reqs": (), "chunk_tokens": (t,),
             # 1 + the prompt token after each token, for rows asking for prompt logprobs; 0 = none
             "prompt_targets": (t,),
             "new_slot": (r,), "new_prefill_len": (r,), "new_num_computed": (r,), "new_num_prompt": (r,),
             "new_sampler_row": (r,), **{f"new_{name}": (r,) for name in SAMPLING_FIELDS},
             "new_stop_ids": (r, MAX_DEVICE_STOP_IDS),
             "append_slot": (max_appends,), "append_index": (max_appends,), "append_block": (max_appends,),
             # Spec decode: for a row still prefilling, 1 + the prompt token after its chunk
             # (0 = none; the MTP proposer's catch-up reads it).
             **({"next_prompt": (r,)} if self.spec else {})},
            float_fields=frozenset(f"new_{name}" for name in FLOAT_SCALAR_FIELDS))

    def _step_fn(self, layout: PackedLayout, features: SamplerFeatures, unroll_layers: bool = False,
                 gemv_projections: bool = False):
        block_size, use_kernels = self.block_size, self.use_kernels
        mesh = None if self.tp is None else self.tp.attention_mesh

        def model(param_leaves):
            lm = self.params.merge(param_leaves)  # a fresh module per trace: the other programs keep theirs
            if unroll_layers:
                lm.layer_unroll = True
            lm.gemv_projections = gemv_projections
            return lm

        def step(param_leaves, kv_cache, state, sampler_state, packed, spec_params, spec_state):
            x = layout.unpack(packed)
            state = prepare.apply_new_requests(state, x["new_slot"], x["new_prefill_len"], x["new_num_computed"],
                                               x["new_num_prompt"], x["new_sampler_row"],
                                               {name: x[f"new_{name}"] for name in SAMPLING_FIELDS},
                                               x["new_stop_ids"])
            state = prepare.apply_block_writes(state, x["append_slot"], x["append_index"], x["append_block"])
            diverged = prepare.diverged_rows(state, x["idx_mapping"], x["num_scheduled"], x["num_reqs"])
            state, inputs = prepare.prepare_inputs(state, x["idx_mapping"], x["num_scheduled"], x["num_reqs"],
                                                   x["chunk_tokens"], block_size)
            sampling, sampler_rows = prepare.batch_sampling(state, x["idx_mapping"], x["num_reqs"])
            sampling, penalties = slot_state.batch_inputs(sampler_state, sampling, sampler_rows)
            attention = PagedAttention(inputs.slot_mapping, inputs.block_tables, inputs.seq_lens,
                                       inputs.query_start_loc, x["num_reqs"], use_kernels=use_kernels, mesh=mesh,
                                       decode_kernel=self.decode_attention, ragged_kernel=self.ragged_attention)
            if self.spec is not None:
                kv_cache, state, sampler_state, spec_state, out = self.spec.v2_step(
                    model(param_leaves), spec_params, spec_state, kv_cache, state, sampler_state,
                    idx_mapping=x["idx_mapping"], num_reqs=x["num_reqs"], inputs=inputs, attention=attention,
                    sampling=sampling, sampler_rows=sampler_rows, penalties=penalties, features=features,
                    next_prompt_token=x["next_prompt"] - 1)
                return kv_cache, state, sampler_state, out, spec_state
            kv_cache, out = forward_and_sample(
                model(param_leaves), kv_cache, input_ids=inputs.input_ids,
                positions=inputs.positions, attention=attention, logits_indices=inputs.logits_indices,
                sampling=sampling, features=features, penalties=penalties, prompt_targets=x["prompt_targets"],
                automata=(sampler_state.automata, self.eos_for_masks))
            if features.penalties:
                sampler_state = slot_state.count_sampled(
                    sampler_state, jnp.where(inputs.samples, sampler_rows, -1), out.tokens)
            if features.structured:
                state = prepare.advance_automata(state, x["idx_mapping"], inputs, sampler_state.automata,
                                                 sampling.automaton_state, out.tokens)
            state = prepare.post_update(state, x["idx_mapping"], x["num_reqs"], inputs, out.tokens)
            out = out._replace(tokens=jnp.where(diverged, prepare.DIVERGED, out.tokens))
            return kv_cache, state, sampler_state, out, spec_state

        return step

    def _fused_fn(self, bucket: Bucket, layout: PackedLayout, features: SamplerFeatures):
        fused = make_fused_decode(layout, features, params=self.params,
                                  block_size=self.block_size, use_kernels=self.use_kernels,
                                  max_steps=self.max_fused_steps, unroll=self.fused_unroll,
                                  eos_for_masks=self.eos_for_masks,
                                  mesh=None if self.tp is None else self.tp.attention_mesh,
                                  on_step=self._on_fused_step if self.stream_in_call else None,
                                  decode_kernel=self.decode_attention, ragged_kernel=self.ragged_attention,
                                  unroll_layers=self.unrolls_layers(bucket),
                                  gemv_projections=self.gemv_one_row and bucket.num_reqs == 1)

        # The step's calling convention (spec params and state in, spec state out), so that
        # one dispatch serves both; fused decode never runs with a spec decoder, so the spec
        # state is passed through untouched.
        def fn(param_leaves, kv_cache, state, sampler_state, packed, spec_params, spec_state):
            return *fused(param_leaves, kv_cache, state, sampler_state, packed), spec_state

        return fn

    def _compile_all(self, show_progress: bool):
        """Every (kind, bucket) x sampler variant: kind "step" is one step of any batch, "fused"
        K decode steps (the buckets in `fused_buckets`)."""
        def step_fn(b):
            return functools.partial(self._step_fn, unroll_layers=self.unrolls_layers(b),
                                     gemv_projections=self.gemv_one_row and b.num_tokens == 1)

        steps = {("step", b): (self._layout(b), step_fn(b)) for b in self.buckets}
        steps |= {("fused", b): (fused_layout(b, self.block_size, self.max_fused_steps),
                                 lambda layout, features, b=b: self._fused_fn(b, layout, features))
                  for b in self.fused_buckets}
        compiled = self._compile_steps(steps, (self.kv_cache, self.state, self.slot_state), show_progress)
        self.compiled = {b: programs for (kind, b), programs in compiled.items() if kind == "step"}
        self.fused = {b: programs for (kind, b), programs in compiled.items() if kind == "fused"}
        entries = jax.ShapeDtypeStruct((OVERFLOW_CHUNK,), jnp.int32)
        self._block_writes = jax.jit(prepare.apply_block_writes, donate_argnums=(0,)).lower(
            self.state, entries, entries, entries).compile()

    def unrolls_layers(self, bucket: Bucket) -> bool:
        """Whether the programs of `bucket` (its step's, and fused decode's) unroll the decoder layers."""
        rows = self.unrolled_layers_max_rows
        return bucket.num_tokens <= self.unrolled_layers_max_tokens and (rows is None or bucket.num_reqs <= rows)

    # --- one step -----------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> "PendingStep | StepResult":
        for req_id in out.finished_req_ids:
            self.slots.free(req_id)
            self._logprob_reqs.pop(req_id, None)
            self._prompt_lp_reqs.pop(req_id, None)
            self._variant_of.pop(req_id, None)
            self._prompts.pop(req_id, None)
            self._num_blocks.pop(req_id, None)
            self.automaton_pool.release(req_id)
            self.grammar_masks.release(req_id)
        req_ids = list(out.num_scheduled_tokens)
        if not req_ids:  # nothing scheduled: no new requests and no new blocks either
            return StepResult({})
        if out.num_fused_steps > 1:
            return self._execute_fused(out, req_ids)
        bucket = self.buckets.pick(out.total_num_scheduled_tokens, len(req_ids))
        layout, variants = self.compiled[bucket]
        packed = layout.empty()  # a fresh buffer per step: the device may still read the last one
        view = lambda name: layout.view(packed, name)  # noqa: E731
        self._write_new_requests(out, view)
        if self.grammar_masks:
            self.slot_state = self.slot_state._replace(
                automata=self.grammar_masks.write(self.slot_state.automata, out.sampling_req_ids))
        appends = self._collect_block_appends(out)
        counts = list(out.num_scheduled_tokens.values())  # in req_ids' order
        view("idx_mapping")[: len(req_ids)] = self.slots.slots_of(req_ids)
        view("num_scheduled")[: len(req_ids)] = counts
        spans = {}  # prompt logprobs: req_id -> (first token index, positions, top n, first position)
        if self._prompts:  # rows still prefilling: send this chunk's known tokens
            chunk, pos = view("chunk_tokens"), 0
            for i, (req_id, n) in enumerate(zip(req_ids, counts)):
                progress = self._prompts.get(req_id)
                if progress is not None:
                    prompt, begin = progress
                    piece = prompt[begin : begin + n]
                    chunk[pos : pos + len(piece)] = piece
                    if self.spec is not None and begin + n < len(prompt):
                        view("next_prompt")[i] = prompt[begin + n] + 1
                    if req_id in self._prompt_lp_reqs:
                        top_n, num_prompt = self._prompt_lp_reqs[req_id]
                        num = max(0, min(n, num_prompt - 1 - begin))
                        if num:
                            spans[req_id] = (pos, num, top_n, begin)
                            targets = np.asarray(prompt[begin + 1 : begin + 1 + num])
                            view("prompt_targets")[pos : pos + num] = targets + 1
                    if begin + n >= len(prompt):
                        del self._prompts[req_id]
                    else:
                        self._prompts[req_id] = (prompt, begin + n)
                pos += n
        view("num_reqs")[...] = len(req_ids)
        capacity = layout.shapes["append_slot"][0]
        self._flush_block_appends(appends[capacity:])
        self._write_appends(view, appends[:capacity])
        return self._dispatch(variants, packed, req_ids, out, spans)

    def _execute_fused(self, out: SchedulerOutput, req_ids: list[str]) -> PendingStep:
        """Up to `out.num_fused_steps` decode steps in one call; row r runs at most
        `num_scheduled_tokens[r]` of them (its budget) and stops early on a stop id."""
        if out.new_reqs or self._prompts.keys() & set(req_ids):
            raise RuntimeError("a fused decode call may only hold requests that are decoding")
        if self.grammar_masks:
            raise RuntimeError("a fused decode call may not hold grammar requests (the host masks every step)")
        if out.num_fused_steps > self.max_fused_steps:
            raise RuntimeError(f"{out.num_fused_steps} fused steps requested; compiled for {self.max_fused_steps}")
        bucket = next(b for b in self.fused_buckets if b.num_reqs >= len(req_ids))
        layout, variants = self.fused[bucket]
        packed = layout.empty()

        def view(name):
            return layout.view(packed, name)

        view("idx_mapping")[: len(req_ids)] = self.slots.slots_of(req_ids)
        view("max_steps")[: len(req_ids)] = list(out.num_scheduled_tokens.values())  # in req_ids' order
        view("num_reqs")[...] = len(req_ids)
        view("num_steps")[...] = out.num_fused_steps
        appends = self._collect_block_appends(out)
        capacity = layout.shapes["append_slot"][0]
        self._flush_block_appends(appends[capacity:])
        self._write_appends(view, appends[:capacity])
        self.num_fused_calls += 1
        if self.stream_in_call:
            tag = self.num_fused_calls % _CALL_TAGS
            view("call_tag")[...] = tag
            self._fused_rows[tag] = list(req_ids)
            self._fused_rows.pop((tag - _CALLS_REMEMBERED) % _CALL_TAGS, None)
        return self._dispatch(variants, packed, req_ids, out)

    def _on_fused_step(self, tag, tokens, output_index) -> None:
        """io_callback of a fused step (an XLA thread): its sampled tokens to the token sink."""
        sink, req_ids = self.token_sink, self._fused_rows.get(int(np.asarray(tag)))
        if sink is None or req_ids is None:
            return
        tokens, output_index = np.asarray(tokens).tolist(), np.asarray(output_index).tolist()  # jax: arrays
        entries = [(req_id, i, t) for req_id, t, i in zip(req_ids, tokens, output_index) if t >= 0]
        if entries:
            sink(entries)

    def _dispatch(self, variants, packed, req_ids: list[str], out: SchedulerOutput,
                  prompt_spans: dict | None = None) -> PendingStep:
        if prompt_spans:
            compiled = variants[-1]
        elif self._variant_of:
            compiled = variants[max(self._variant_of.get(r, 0) for r in req_ids)]
        else:
            compiled = variants[0]
        # A decoding batch between two KV blocks sends the same input every step: while its bytes
        # repeat, the call gets the device copy that the first such call returned (last_input).
        data = packed.tobytes() if self.tp is None else None
        repeated = self._repeated_input
        argument = repeated[1] if repeated is not None and repeated[0] == data else packed
        start = time.perf_counter()
        result = self.call_step(compiled if self.step_twins is None else self.step_twins.pick(compiled), argument)
        if argument is packed and data is not None:
            self._repeated_input = (data, self.last_input)
        if self.hooks is not None:  # benchmarks: the call, its input and its host time
            self.hooks.dispatched(self, compiled, packed, time.perf_counter() - start)
        if self.tp is not None:  # several processes: read this process's copy of the replicated outputs
            result = self.tp.local(result)
        wants_logprobs = ({r: self._logprob_reqs[r] for r in out.sampling_req_ids if r in self._logprob_reqs}
                          if self._logprob_reqs else {})  # (most batches: nobody asked)
        return PendingStep(result, req_ids, out.sampling_req_ids, wants_logprobs, prompt_spans)

    def call_step(self, compiled, packed):
        """Run one compiled step on the runner's state, which the call donates and replaces;
        -> the step's device result. Benchmarks replay captured steps through it."""
        if self.tp is not None and self.tp.multi_process:  # every process passes the same buffer
            packed = self.tp.put(packed, self.tp.replicated)
        (self.kv_cache, self.state), result = self._call_program(compiled, (self.kv_cache, self.state), packed)
        return result

    def _write_new_requests(self, out: SchedulerOutput, view):
        new_slot, sampler_row = view("new_slot"), view("new_sampler_row")
        new_slot[:] = -1
        sampler_row[:] = -1
        if not out.new_reqs:
            return
        # The fields' views once per step, not once per request and field.
        prefill_len, num_computed, num_prompt, stop_ids = (
            view(name) for name in ("new_prefill_len", "new_num_computed", "new_num_prompt", "new_stop_ids"))
        fields = [(name, view(f"new_{name}")) for name in SAMPLING_FIELDS]
        for i, new in enumerate(out.new_reqs):
            slot = self.slots.allocate(new.req_id)
            new_slot[i] = slot
            prefill_len[i] = len(new.token_ids)
            num_computed[i] = new.num_computed_tokens
            num_prompt[i] = new.num_prompt_tokens
            # Penalty counts, prompt masks, bias and min_tokens lists are written once, by their
            # own small dispatch, only for requests that use them.
            row, owns_rows = self._new_sampling_row(new, slot)
            if new.automaton is not None:
                row.scalars["automaton_state"] = self._load_automaton(new)
            for name, field_view in fields:
                field_view[i] = row.scalars[name]
            stop_ids[i] = device_stop_ids(new.sampling_params, self.eos_token_ids)
            if owns_rows:
                sampler_row[i] = slot
            if row.scalars["num_logprobs"] >= 0:
                self._logprob_reqs[new.req_id] = row.scalars["num_logprobs"]
            if new.sampling_params.prompt_logprobs is not None and self.supports_prompt_logprobs:
                self._prompt_lp_reqs[new.req_id] = (new.sampling_params.prompt_logprobs, new.num_prompt_tokens)
            if not is_plain_greedy(row):
                self._variant_of[new.req_id] = self._smallest_variant(row)
            self._prompts[new.req_id] = (list(new.token_ids), new.num_computed_tokens)

    def _load_automaton(self, new) -> int:
        """Put a constrained request's automaton in the device pool (unless it is there) -> the
        global id of its state: the start, or where its outputs so far led (a resumed request)."""
        automaton = new.automaton
        state_base, exception_base, fresh = self.automaton_pool.acquire(new.req_id, automaton)
        if fresh:
            self.slot_state = self.slot_state._replace(automata=self._automaton_writer.write(
                self.slot_state.automata, automaton, state_base, exception_base))
        if not automaton.shared:  # a grammar: its matcher masks the one state before each step
            self.grammar_masks.add(new.req_id, automaton, state_base)
        return state_base + automaton.walk(new.token_ids[new.num_prompt_tokens:])

    def _smallest_variant(self, row) -> int:
        needs = row_needs(row, self.vocab_size)
        last = len(self.sampler_variants) - 1
        return next((i for i, f in enumerate(self.sampler_variants) if f.covers(needs)), last)

    def _collect_block_appends(self, out: SchedulerOutput) -> list[tuple[int, int, int]]:
        """(slot, index in the block table, block id) for every block added this step."""
        appends = []
        for new in out.new_reqs:
            appends += self._appends_for(new.req_id, new.block_ids, self.slots.slot_of(new.req_id))
        for cached in out.cached_reqs:
            if cached.new_block_ids:  # most decode steps add none: skip the per-row work
                appends += self._appends_for(cached.req_id, cached.new_block_ids, self.slots.slot_of(cached.req_id))
        return appends

    def _appends_for(self, req_id, block_ids, slot):
        first = self._num_blocks.get(req_id, 0)
        self._num_blocks[req_id] = first + len(block_ids)
        return [(slot, first + k, b) for k, b in enumerate(block_ids)]

    def _write_appends(self, view, appends):
        slot, index, block = view("append_slot"), view("append_index"), view("append_block")
        slot[:] = -1
        if appends:
            a = np.asarray(appends, np.int32)
            slot[: len(a)], index[: len(a)], block[: len(a)] = a[:, 0], a[:, 1], a[:, 2]

    def _flush_block_appends(self, appends):
        """Block-table writes that do not fit the step's buffer (a long prefix-cache hit) go in
        extra dispatches of a fixed size, compiled at start-up like everything else."""
        for lo in range(0, len(appends), OVERFLOW_CHUNK):
            part = appends[lo : lo + OVERFLOW_CHUNK]
            a = np.zeros((OVERFLOW_CHUNK, 3), np.int32)
            a[:, 0] = -1
            a[: len(part)] = part
            self.state = self._block_writes(self.state, a[:, 0], a[:, 1], a[:, 2])
