"""Model Runner V1: every input array is built on the CPU with numpy, each step.

This is the baseline arm of the V1/V2 comparison, written the way vLLM's V1 runner works:
persistent CPU tables (token ids, block tables) indexed by a per-request slot, vectorised numpy
to build input_ids / positions / slot_mapping / block tables / query_start_loc / seq_lens /
logits_indices, one packed host->device transfer, the jitted step, and then a blocking read of
the sampled tokens before the scheduler may run again (the runner needs their values to build
the next step's input_ids, so V1 is synchronous by construction).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from mrv2_jax.engine.scheduler_output import SchedulerOutput
from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.runner.buckets import Bucket, BucketPlan
from mrv2_jax.runner.kv_cache import allocate_kv_cache
from mrv2_jax.runner.model_step import FlatParams, forward_and_sample
from mrv2_jax.runner.packed import PackedLayout
from mrv2_jax.runner.step_result import StepResult
from mrv2_jax.runner.slots import SlotAllocator


class ModelRunnerV1:
    is_async_capable = False

    def __init__(self, model_state, lm, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype=jnp.bfloat16,
                 use_kernels: bool | None = None, show_progress: bool = True):
        self.model_state = model_state
        self.params = FlatParams(lm)
        self.block_size = block_size
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.use_kernels = jax.default_backend() == "gpu" if use_kernels is None else use_kernels
        self.kv_cache = allocate_kv_cache(model_state, num_blocks, block_size, kv_dtype)
        self.buckets = BucketPlan(max_num_batched_tokens, max_num_seqs)
        self.slots = SlotAllocator(max_num_seqs)
        # Persistent CPU tables, one row per slot.
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), np.int32)
        self.num_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_computed = np.zeros(max_num_seqs, np.int32)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)
        self.temperature = np.zeros(max_num_seqs, np.float32)
        self.seed = np.zeros(max_num_seqs, np.int32)
        self._seed_rng = np.random.default_rng()
        self.compiled = {}
        self._compile_all(show_progress)

    # --- compilation ---------------------------------------------------------------------
    def _layout(self, bucket: Bucket) -> PackedLayout:
        t, r = bucket.num_tokens, bucket.num_reqs
        return PackedLayout(
            {"input_ids": (t,), "positions": (t,), "slot_mapping": (t,), "logits_indices": (r,),
             "seq_lens": (r,), "query_start_loc": (r + 1,), "num_seqs": (), "seeds": (r,),
             "temperature": (r,), "block_tables": (r, self.max_blocks_per_seq)},
            float_fields=frozenset({"temperature"}))

    def _step_fn(self, layout: PackedLayout):
        def step(param_leaves, kv_cache, packed):
            x = layout.unpack(packed)
            attention = PagedAttention(x["slot_mapping"], x["block_tables"], x["seq_lens"],
                                       x["query_start_loc"], x["num_seqs"], use_kernels=self.use_kernels)
            return forward_and_sample(
                self.params.merge(param_leaves), kv_cache, input_ids=x["input_ids"],
                positions=x["positions"], attention=attention, logits_indices=x["logits_indices"],
                temperature=x["temperature"], seeds=x["seeds"])
        return step

    def _compile_all(self, show_progress: bool):
        """Every bucket is compiled ahead of time; a step outside them is an error, never a
        silent recompile."""
        for bucket in tqdm(self.buckets, desc="compiling step buckets", disable=not show_progress):
            layout = self._layout(bucket)
            packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
            lowered = jax.jit(self._step_fn(layout), donate_argnums=(1,)).lower(
                self.params.leaves, self.kv_cache, packed)
            self.compiled[bucket] = (layout, lowered.compile())

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
            params = new.sampling_params
            self.temperature[s] = params.temperature
            self.seed[s] = params.seed if params.seed is not None else self._seed_rng.integers(2**31)
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
        layout, compiled = self.compiled[bucket]
        packed = layout.empty()
        self._build_inputs(layout, packed, rows, counts, total)
        self.kv_cache, tokens = compiled(self.params.leaves, self.kv_cache, packed)
        tokens = np.asarray(tokens)  # the V1 sync point: the next step needs these values
        self.num_computed[rows] += counts
        sampled = {}
        for i, req_id in enumerate(req_ids):
            if req_id in out.sampling_req_ids:
                s = rows[i]
                self.token_ids[s, self.num_tokens[s]] = tokens[i]
                self.num_tokens[s] += 1
                sampled[req_id] = [int(tokens[i])]
        return StepResult(sampled)

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
        view("seeds")[:r] = self.seed[rows]
        view("temperature")[:r] = self.temperature[rows]
        view("block_tables")[:r] = self.block_table[rows]
