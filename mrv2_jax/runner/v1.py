"""Model Runner V1: every input array is built on the CPU with numpy, each step.

This is the baseline arm of the V1/V2 comparison, written the way vLLM's V1 runner works:
persistent CPU tables (token ids, block tables) indexed by a per-request slot, vectorised numpy
to build input_ids / positions / slot_mapping / block tables / query_start_loc / seq_lens /
logits_indices, one packed host->device transfer, the jitted step, and then a blocking read of
the sampled tokens before the scheduler may run again (the runner needs their values to build
the next step's input_ids, so V1 is synchronous by construction).

Sampling parameters: the per-row scalars (temperature, top_k, top_p, min_p, seed, penalties,
min_tokens, output count, logprobs) travel in the packed buffer every step, from a per-slot
CPU table. What is large and fixed per request - penalty counts and prompt masks ([V] each),
logit_bias and min_tokens stop lists - lives in per-slot DEVICE tables (sample/slot_state.py):
written once when a request arrives (only if it uses them), gathered by slot in the step, and
the step itself bumps the output-token counts, so no [R, V] matrix ever crosses per step.

Speculative decoding: the host puts each decode row's drafts in its input ids (they sit in the
CPU token table after the row's known tokens), the step verifies them on the device and returns
the kept tokens and the next drafts (a draft model's, drafted in the same step; n-gram drafts are
computed here on the host, as vLLM's V1 does), and the host waits for all of them as usual.
"""

import jax.numpy as jnp
import numpy as np

from mrv2_jax.config import MAX_LOGIT_BIAS, MAX_STOP_IDS
from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.runner.base import RunnerBase
from mrv2_jax.runner.buckets import Bucket
from mrv2_jax.runner.model_step import forward_and_sample
from mrv2_jax.runner.packed import PackedLayout
from mrv2_jax.runner.prepare import StepInputs
from mrv2_jax.runner.scheduler_output import SchedulerOutput
from mrv2_jax.runner.step_result import StepResult, prompt_spans, prompt_token_logprobs
from mrv2_jax.runner.token_logprobs import LogprobBlock, LogprobRow
from mrv2_jax.sample import slot_state
from mrv2_jax.sample.features import SamplerFeatures
from mrv2_jax.sample.tensors import (
    FLOAT_SCALAR_FIELDS,
    SCALAR_FIELDS,
    SamplingTable,
    SamplingTensors,
    needed_features,
)


class ModelRunnerV1(RunnerBase):
    is_async_capable = False
    _none_fields = ("slot_mapping", "table_row", "count_row")

    def __init__(self, model_state, lm, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype=jnp.bfloat16,
                 use_kernels: bool | None = None, show_progress: bool = True,
                 sampler_variants: tuple[SamplerFeatures, ...] | None = None, spec_decoder=None,
                 compile_mode: str = "eager", program_store=None, tensor_parallel=None,
                 bucket_token_sizes: tuple[int, ...] | None = None, ragged_attention: str = "pallas"):
        """Arguments as RunnerBase's; per step the first sampler variant that covers the batch
        runs (by default greedy, plain sampling, then every feature behind runtime skips).
        `tensor_parallel`: only a runner.pipeline_parallel.PipelineParallel (the attention runs
        whole on each stage); tensor parallelism needs the v2 runner."""
        super().__init__(model_state, lm, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                         kv_dtype=kv_dtype, use_kernels=use_kernels, sampler_variants=sampler_variants,
                         spec_decoder=spec_decoder, compile_mode=compile_mode, program_store=program_store,
                         tensor_parallel=tensor_parallel, bucket_token_sizes=bucket_token_sizes,
                         ragged_attention=ragged_attention)
        # Persistent CPU tables, one row per slot.
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), np.int32)
        self.num_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_computed = np.zeros(max_num_seqs, np.int32)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)
        self.num_prompt = np.zeros(max_num_seqs, np.int32)
        self.prompt_top_n = np.full(max_num_seqs, -1, np.int32)  # prompt_logprobs n, -1 = none
        self.sampling = SamplingTable(max_num_seqs, MAX_LOGIT_BIAS, MAX_STOP_IDS)
        self.table_row = np.full(max_num_seqs, -1, np.int32)  # slot if its device rows are valid
        self.compiled = self._compile_steps({b: (self._layout(b), self._step_fn) for b in self.buckets},
                                            (self.kv_cache, self.slot_state), show_progress)

    # --- compilation ---------------------------------------------------------------------
    def _layout(self, bucket: Bucket) -> PackedLayout:
        t, r = bucket.num_tokens, bucket.num_reqs
        return PackedLayout(
            {"input_ids": (t,), "positions": (t,), "slot_mapping": (t,), "logits_indices": (r,),
             "seq_lens": (r,), "query_start_loc": (r + 1,), "num_seqs": (),
             "block_tables": (r, self.max_blocks_per_seq),
             **{name: (r,) for name in SCALAR_FIELDS},
             # 1 + the prompt token after each token, for rows asking for prompt logprobs; 0 = none
             "prompt_targets": (t,),
             "table_row": (r,),  # slot whose device sampler rows this row uses, or -1
             "count_row": (r,),  # table_row if the row samples a token now, else -1
             # Spec decode: drafts in the row's tokens, whether it samples, its slot, and for a row
             # still prefilling 1 + the prompt token after its chunk (0 = none; MTP reads it).
             **({"num_draft": (r,), "samples": (r,), "slot": (r,), "next_prompt": (r,)} if self.spec else {})},
            float_fields=FLOAT_SCALAR_FIELDS)

    def _step_fn(self, layout: PackedLayout, features: SamplerFeatures):
        def step(param_leaves, kv_cache, sampler_state, packed, spec_params, spec_state):
            x = layout.unpack(packed)
            attention = PagedAttention(x["slot_mapping"], x["block_tables"], x["seq_lens"],
                                       x["query_start_loc"], x["num_seqs"], use_kernels=self.use_kernels,
                                       ragged_kernel=self.ragged_attention)
            sampling = SamplingTensors(**{name: x[name] for name in SCALAR_FIELDS},
                                       bias_ids=None, bias_values=None, stop_ids=None)
            sampling, penalties = slot_state.batch_inputs(sampler_state, sampling, x["table_row"])
            if self.spec is not None:
                inputs = StepInputs(x["input_ids"], x["positions"], x["slot_mapping"], x["query_start_loc"],
                                    x["seq_lens"], x["logits_indices"], x["block_tables"], x["samples"] > 0)
                kv_cache, sampler_state, spec_state, out, drafts = self.spec.v1_step(
                    self.params.merge(param_leaves), spec_params, spec_state, kv_cache, sampler_state,
                    inputs=inputs, num_draft=x["num_draft"], samples=inputs.samples, slots=x["slot"],
                    num_reqs=x["num_seqs"], attention=attention, sampling=sampling, table_rows=x["table_row"],
                    features=features, penalties=penalties, next_prompt_token=x["next_prompt"] - 1)
                return kv_cache, sampler_state, (out, drafts), spec_state
            kv_cache, out = forward_and_sample(
                self.params.merge(param_leaves), kv_cache, input_ids=x["input_ids"],
                positions=x["positions"], attention=attention, logits_indices=x["logits_indices"],
                sampling=sampling, features=features, penalties=penalties, prompt_targets=x["prompt_targets"])
            if features.penalties:
                sampler_state = slot_state.count_sampled(sampler_state, x["count_row"], out.tokens)
            return kv_cache, sampler_state, out, spec_state
        return step

    # --- per-step state changes ------------------------------------------------------------
    def _apply_scheduler_changes(self, out: SchedulerOutput):
        for req_id in out.finished_req_ids:
            self.slots.free(req_id)
        for new in out.new_reqs:
            s = self.slots.allocate(new.req_id)
            n = len(new.token_ids)
            self.token_ids[s, :n] = new.token_ids
            self.num_tokens[s] = n
            self.num_computed[s] = new.num_computed_tokens
            self.num_blocks[s] = 0
            self._append_blocks(s, new.block_ids)
            self.num_prompt[s] = new.num_prompt_tokens
            top_n = new.sampling_params.prompt_logprobs
            self.prompt_top_n[s] = -1 if top_n is None or not self.supports_prompt_logprobs else top_n
            row, owns_rows = self._new_sampling_row(new, s)
            self.sampling.write(s, row)
            self.table_row[s] = s if owns_rows else -1
        for cached in out.cached_reqs:
            s = self.slots.slot_of(cached.req_id)
            self._append_blocks(s, cached.new_block_ids)

    def _append_blocks(self, slot: int, block_ids: list[int]):
        n = self.num_blocks[slot]
        self.block_table[slot, n : n + len(block_ids)] = block_ids
        self.num_blocks[slot] = n + len(block_ids)

    # --- one step -----------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> "StepResult":
        """Run one scheduled step; its result holds the sampled token of every row that
        samples. V1 has already waited for the values when this returns."""
        self._apply_scheduler_changes(out)
        req_ids = list(out.num_scheduled_tokens)
        if not req_ids:
            return StepResult({})
        rows = np.array([self.slots.slot_of(r) for r in req_ids], np.int32)
        counts = np.array([out.num_scheduled_tokens[r] for r in req_ids], np.int32)
        total = int(counts.sum())
        bucket = self.buckets.pick(total, len(rows))
        layout, variants = self.compiled[bucket]
        packed = layout.empty()
        samples = np.array([r in out.sampling_req_ids for r in req_ids])
        self._build_inputs(layout, packed, rows, counts, total)
        self._build_sampling_inputs(layout, packed, rows, samples, bucket.num_reqs)
        if self.spec:
            num_draft = np.where(samples, np.maximum(self.num_computed[rows] + counts - self.num_tokens[rows], 0), 0)
            layout.view(packed, "num_draft")[: len(rows)] = num_draft
            layout.view(packed, "samples")[: len(rows)] = samples
            layout.view(packed, "slot")[: len(rows)] = rows
            end = self.num_computed[rows] + counts
            prefilling = ~samples & (end < self.num_tokens[rows])
            next_prompt = self.token_ids[rows, np.minimum(end, self.token_ids.shape[1] - 1)] + 1
            layout.view(packed, "next_prompt")[: len(rows)] = np.where(prefilling, next_prompt, 0)
        spans = self._prompt_targets(layout, packed, req_ids, rows, counts)
        if spans:  # only the full variant computes prompt logprobs
            compiled = variants[-1]
            if not self.sampler_variants[-1].prompt_logprobs:
                raise RuntimeError("prompt_logprobs needs a sampler variant with prompt_logprobs=True")
        else:
            compiled = self._pick_variant(layout, packed, variants)
        result = self.call_step(compiled, packed)
        if self.spec:
            return self._finish_spec_step(req_ids, rows, counts, samples, num_draft, layout, packed, *result)
        tokens = np.asarray(result.tokens)  # the V1 sync point: the next step needs these values
        self.num_computed[rows] += counts
        num_logprobs = layout.view(packed, "num_logprobs")
        want_logprobs = samples & (num_logprobs[: len(rows)] >= 0)
        if want_logprobs.any():
            block = LogprobBlock.of(result.logprobs, result.logprob_token_ids, result.sampled_rank)
        sampled, sampled_logprobs = {}, {}
        for i, req_id in enumerate(req_ids):
            if samples[i]:
                s = rows[i]
                self.token_ids[s, self.num_tokens[s]] = tokens[i]
                self.num_tokens[s] += 1
                sampled[req_id] = [int(tokens[i])]
                if want_logprobs[i]:
                    sampled_logprobs[req_id] = [LogprobRow(block, i, num_logprobs[i])]
        return StepResult(sampled, sampled_logprobs, prompt_token_logprobs(result, spans))

    def call_step(self, compiled, packed):
        (self.kv_cache,), result = self._call_program(compiled, (self.kv_cache,), packed)
        return result

    def _prompt_targets(self, layout, packed, req_ids, rows, counts) -> dict:
        """Fill `prompt_targets` for rows asking for prompt logprobs -> their spans (see
        step_result.prompt_spans). Call before the step: num_computed is the chunk's start."""
        top_n = self.prompt_top_n[rows]
        if not (top_n >= 0).any():
            return {}
        starts = self.num_computed[rows]
        token_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
        spans = prompt_spans(req_ids, starts, counts, self.num_prompt[rows], top_n, token_start)
        targets = layout.view(packed, "prompt_targets")
        for i, r in enumerate(req_ids):
            if r in spans:
                first, num, _, _ = spans[r]
                s, p = rows[i], starts[i]
                targets[first : first + num] = self.token_ids[s, p + 1 : p + 1 + num] + 1
        return spans

    def _finish_spec_step(self, req_ids, rows, counts, samples, num_draft, layout, packed, result, drafts):
        """Read the kept tokens (the sync point), advance the tables, place the next drafts."""
        tokens, num_sampled = np.asarray(result.tokens), np.asarray(result.num_sampled)[: len(rows)]
        first = self.num_computed[rows] + counts - num_draft  # position of each row's first sampled token
        self.num_computed[rows] = np.where(samples, first + num_sampled - 1, self.num_computed[rows] + counts)
        sampled, sampled_logprobs, block = {}, {}, None
        num_logprobs = layout.view(packed, "num_logprobs")
        for i in np.flatnonzero(samples):
            s, n = rows[i], num_sampled[i]
            self.token_ids[s, first[i] : first[i] + n] = tokens[i, :n]
            self.num_tokens[s] = first[i] + n
            sampled[req_ids[i]] = tokens[i, :n].tolist()
            if num_logprobs[i] >= 0:  # (such rows carry no drafts: their logprobs are of index 0)
                if block is None:
                    block = LogprobBlock.of(result.logprobs, result.logprob_token_ids, result.sampled_rank)
                sampled_logprobs[req_ids[i]] = [LogprobRow(block, i, num_logprobs[i])]
        sampling_slots = rows[samples]
        if self.spec.proposer.reads_token_table:  # n-gram: drafted here, from the CPU table
            drafts = self.spec.proposer.propose_host(self.token_ids[sampling_slots], self.num_tokens[sampling_slots])
        else:
            drafts = np.asarray(drafts)[: len(rows)][samples]
        width = self.token_ids.shape[1]
        for s, row_drafts in zip(sampling_slots, drafts):
            n = self.num_tokens[s]
            room = max(0, min(len(row_drafts), width - n))
            self.token_ids[s, n : n + room] = row_drafts[:room]
        return StepResult(sampled, sampled_logprobs)

    def _build_sampling_inputs(self, layout, packed, rows, samples, num_rows):
        """Per-row sampler scalars from the per-slot table; padding rows stay neutral."""
        r = len(rows)
        batch = self.sampling.gather_scalars(rows, num_rows)
        batch["num_output_tokens"][:r] = self.num_tokens[rows] - self.num_prompt[rows]
        for name, values in batch.items():
            layout.view(packed, name)[:] = values
        table_row = layout.view(packed, "table_row")
        table_row[:] = -1
        table_row[:r] = self.table_row[rows]
        count_row = layout.view(packed, "count_row")
        count_row[:] = table_row
        count_row[:r] = np.where(samples, table_row[:r], -1)

    def _pick_variant(self, layout, packed, variants):
        if len(variants) == 1:
            return variants[0]
        n = int(layout.view(packed, "num_seqs"))
        table_rows = layout.view(packed, "table_row")[:n]
        rows = np.maximum(table_rows, 0)
        has_rows = (table_rows >= 0)[:, None]
        arrays = self.sampling.arrays
        t = SamplingTensors(**{name: layout.view(packed, name)[:n] for name in SCALAR_FIELDS},
                            bias_ids=np.where(has_rows, arrays["bias_ids"][rows], -1), bias_values=None,
                            stop_ids=np.where(has_rows, arrays["stop_ids"][rows], -1))
        needed = needed_features(t, self.vocab_size)
        for features, compiled in zip(self.sampler_variants, variants):
            if features.covers(needed):
                return compiled
        raise RuntimeError(f"no compiled sampler variant covers {needed}")

    def _build_inputs(self, layout, packed, rows, counts, total):
        bs = self.block_size
        qsl = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(counts, out=qsl[1:])
        row_of_token = np.repeat(rows, counts)
        positions = np.repeat(self.num_computed[rows] - qsl[:-1], counts) + np.arange(total, dtype=np.int32)
        view = lambda name: layout.view(packed, name)  # noqa: E731
        view("input_ids")[:total] = self.token_ids[row_of_token, positions]
        view("positions")[:total] = positions
        slot_mapping = view("slot_mapping")
        slot_mapping[:] = -1
        slot_mapping[:total] = self.block_table[row_of_token, positions // bs] * bs + positions % bs
        r = len(rows)
        view("logits_indices")[:r] = qsl[1:] - 1
        view("seq_lens")[:r] = self.num_computed[rows] + counts
        query_start_loc = view("query_start_loc")
        query_start_loc[: r + 1] = qsl
        query_start_loc[r + 1 :] = total
        view("num_seqs")[...] = r
        view("block_tables")[:r] = self.block_table[rows]
