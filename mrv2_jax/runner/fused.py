"""Fused decode: several decode steps in one compiled call.

At small batches the host, not the device, sets the pace: scheduling, packing and dispatching
one step costs the host about as much as the device's work for a small batch's decode step, or
more (docs/architecture.md, "Fused decode"; docs/benchmarks.md, "Small-batch decode"). When every scheduled row is
decoding and none needs the host for a while, the scheduler asks for K steps at once, and this
module runs them inside ONE compiled call: a `lax.while_loop` over
    prepare inputs -> forward -> sample -> post-update
with everything on the device, the tokens sampled by step k being the inputs of step k + 1.

Each row has its own step budget (`max_steps[r]`: max_tokens and max_model_len, counted by
the scheduler) and stops early on the device when it samples one of its stop ids (EOS unless
ignored, stop_token_ids; see `DeviceState.stop_ids`) once min_tokens outputs exist. A stopped
row schedules 0 tokens in the remaining steps: it writes no KV, appends no token, and the loop
exits as soon as no row is active, so a finished batch-1 request costs no further device time.
The call returns the tokens as `[K, R]`, -1 where a row sampled nothing; a row's tokens are
always a prefix of its column. Structured outputs need no host either: each step masks the
constrained rows by their automaton state and advances it with the sampled token.

With `on_step` (the server's engine process streams in the call), every step also hands its
tokens to the host through `io_callback` as soon as they are sampled: `on_step(call_tag, tokens,
output_index)`, tokens [R] (-1 where a row sampled nothing) and each row's index among its
request's outputs. A stream then gets every token as it is made instead of K at a time, and the
call's results still come back whole at its end (the engine's bookkeeping is unchanged).

The trip count is a run-time value (`num_steps`), so one variant per (bucket, sampler
variant) serves every K up to the compiled maximum. `unroll` > 1 runs that many steps per loop
iteration (each still masked by the row budgets), trading compile time for fewer loop
iterations, for the measurement of XLA's while loop against command buffers (`+WHILE`).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.runner import prepare
from mrv2_jax.runner.buckets import Bucket
from mrv2_jax.runner.device_state import MAX_DEVICE_STOP_IDS, DeviceState
from mrv2_jax.runner.model_step import FlatParams, forward_and_sample
from mrv2_jax.runner.packed import PackedLayout
from mrv2_jax.sample import slot_state
from mrv2_jax.sample.features import SamplerFeatures
from mrv2_jax.sample.sampler import SamplerOutput
from mrv2_jax.sampling_params import SamplingParams

# The tokens a one-row fused step computes (one real, the rest padding): a one-token product is a
# vector-matrix product, which XLA rewrites into multiply and reduce fusions, slower than cuBLAS's
# GEMM of 8 rows (docs/benchmarks.md, "Fused decode of one row").
ONE_ROW_TOKENS = 8


def _stop_ids(params: SamplingParams, eos_token_ids) -> list[int]:
    """The ids that end this request, each once, stop_token_ids first."""
    return list(dict.fromkeys([*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]))


def device_stop_ids(params: SamplingParams, eos_token_ids) -> np.ndarray:
    """int32[MAX_DEVICE_STOP_IDS]: the ids that end this request, -1 padded. Only the first
    ones are kept (the host still checks every token: see MAX_DEVICE_STOP_IDS)."""
    ids = _stop_ids(params, eos_token_ids)[:MAX_DEVICE_STOP_IDS]
    out = np.full(MAX_DEVICE_STOP_IDS, -1, np.int32)
    out[: len(ids)] = ids
    return out


def stops_on_device(params: SamplingParams, eos_token_ids) -> bool:
    """Whether the device checks every id that ends this request (then a fused call's tokens
    are exactly the ones the host will keep)."""
    return len(_stop_ids(params, eos_token_ids)) <= MAX_DEVICE_STOP_IDS


def fused_layout(bucket: Bucket, block_size: int, max_steps: int) -> PackedLayout:
    """The packed host buffer of a fused call: the batch, each row's step budget, the trip
    count, and the block-table appends for up to `max_steps` tokens per row."""
    r = bucket.num_reqs
    max_appends = r * (max_steps // block_size + 2)
    return PackedLayout({"idx_mapping": (r,), "num_reqs": (), "num_steps": (), "call_tag": (), "max_steps": (r,),
                         "append_slot": (max_appends,), "append_index": (max_appends,),
                         "append_block": (max_appends,)})


def rows_ended(state: DeviceState, idx_mapping) -> jax.Array:
    """bool[R]: the row's last token is one of its stop ids and counts (an output, and at least
    min_tokens outputs exist). Such a row is finished; a call dispatched before the host knew
    that (async scheduling) must not decode it further."""
    num_tokens = state.num_tokens[idx_mapping]
    last = state.token_ids[idx_mapping, jnp.maximum(num_tokens - 1, 0)]
    outputs = num_tokens - state.num_prompt[idx_mapping]
    may_stop = outputs >= jnp.maximum(state.scalars["min_tokens"][idx_mapping], 1)
    return may_stop & jnp.any(state.stop_ids[idx_mapping] == last[:, None], axis=-1)


def make_fused_decode(layout: PackedLayout, features: SamplerFeatures, *, params: FlatParams,
                      block_size: int, use_kernels: bool, max_steps: int, unroll: int = 1, eos_for_masks: int = 0,
                      mesh=None, on_step=None, decode_kernel: str = "pallas", ragged_kernel: str = "pallas",
                      unroll_layers: bool = False, gemv_projections: bool = False):
    """-> fused(param_leaves, kv_cache, state, sampler_state, packed)
            -> (kv_cache, state, sampler_state, SamplerOutput with [max_steps, R, ...] fields).
    `mesh`: tensor parallelism's mesh for the attention (models/attention.py), or None.
    `on_step`: a host function that gets each step's tokens during the call (see above), or None.
    `decode_kernel`: the attention kernel of its steps, "pallas" or "mgpu" (models/attention.py);
    `ragged_kernel`: the one used where `decode_kernel` is "pallas".
    `unroll_layers`: every decoder layer unrolled in the step's body (else the model's `layer_unroll`).
    `gemv_projections` (the one-row bucket): the family's layer runs its projections through the GEMV
    kernel (CausalLM.gemv_projections), and the bucket computes its one token instead of padding to
    ONE_ROW_TOKENS."""

    def fused(param_leaves, kv_cache, state, sampler_state, packed):
        x = layout.unpack(packed)
        idx, num_reqs, budget = x["idx_mapping"], x["num_reqs"], x["max_steps"]
        state = prepare.apply_block_writes(state, x["append_slot"], x["append_index"], x["append_block"])
        num_rows = idx.shape[0]
        real_row = jnp.arange(num_rows) < num_reqs
        decoding = state.num_computed[idx] + 1 == state.num_tokens[idx]
        active = real_row & decoding & (budget > 0) & ~rows_ended(state, idx)
        diverged = prepare.diverged_rows(state, idx, budget, num_reqs)
        # One token per row, read from the tables (no chunk of prompt tokens); one row pads to
        # ONE_ROW_TOKENS, so that its projections stay GEMMs, unless they run as the GEMV kernels.
        num_tokens = ONE_ROW_TOKENS if num_rows == 1 and not gemv_projections else num_rows
        no_chunk = jnp.zeros((num_tokens,), jnp.int32)
        # The loop carries the penalty counts only: the sampler's other tables are read, never written.
        counts, tables = slot_state.split(sampler_state)

        def one_step(step, carry):
            kv_cache, state, counts, active, produced, outs = carry
            sampler_state = slot_state.join(counts, tables)
            active = active & (step < x["num_steps"])
            # An inactive row schedules 0 tokens: no KV write, no sample, no token appended.
            state, inputs = prepare.prepare_inputs(state, idx, active.astype(jnp.int32), num_reqs, no_chunk,
                                                   block_size)
            sampling, sampler_rows = prepare.batch_sampling(state, idx, num_reqs)
            sampling, penalties = slot_state.batch_inputs(sampler_state, sampling, sampler_rows)
            attention = PagedAttention(inputs.slot_mapping, inputs.block_tables, inputs.seq_lens,
                                       inputs.query_start_loc, num_reqs, use_kernels=use_kernels, mesh=mesh,
                                       one_token_rows=num_tokens == num_rows, decode_kernel=decode_kernel,
                                       ragged_kernel=ragged_kernel)
            lm = params.merge(param_leaves)
            if unroll_layers:
                lm.layer_unroll = True
            lm.gemv_projections = gemv_projections
            kv_cache, out = forward_and_sample(
                lm, kv_cache, input_ids=inputs.input_ids, positions=inputs.positions,
                attention=attention, logits_indices=inputs.logits_indices, sampling=sampling,
                features=features, penalties=penalties, automata=(sampler_state.automata, eos_for_masks))
            sampled = inputs.samples
            if features.penalties:
                sampler_state = slot_state.count_sampled(
                    sampler_state, jnp.where(sampled, sampler_rows, -1), out.tokens)
            if features.structured:  # each constrained row's automaton steps with its token
                state = prepare.advance_automata(state, idx, inputs, sampler_state.automata,
                                                 sampling.automaton_state, out.tokens)
            state = prepare.post_update(state, idx, num_reqs, inputs, out.tokens)
            produced = produced + sampled.astype(jnp.int32)
            outs = _record(outs, step, out, sampled)
            if on_step is not None:
                output_index = state.num_tokens[idx] - state.num_prompt[idx] - 1
                io_callback(on_step, None, x["call_tag"], jnp.where(sampled, out.tokens, -1), output_index,
                            ordered=False)
            active = sampled & (produced < budget) & ~rows_ended(state, idx)
            return kv_cache, state, sampler_state.output_counts, active, produced, outs

        def body(loop):
            step, carry = loop
            for u in range(unroll):
                carry = one_step(step + u, carry)
            return step + unroll, carry

        def keep_going(loop):
            step, carry = loop
            return (step < x["num_steps"]) & jnp.any(carry[3])

        outs = _empty_outputs(max_steps, num_rows, features)
        carry = (kv_cache, state, counts, active, jnp.zeros(num_rows, jnp.int32), outs)
        _, (kv_cache, state, counts, _, _, outs) = jax.lax.while_loop(
            keep_going, body, (jnp.int32(0), carry))
        first = jnp.where(diverged, prepare.DIVERGED, outs.tokens[0])  # the host stops on it (prepare.py)
        return kv_cache, state, slot_state.join(counts, tables), outs._replace(tokens=outs.tokens.at[0].set(first))

    return fused


def _empty_outputs(max_steps: int, num_rows: int, features: SamplerFeatures) -> SamplerOutput:
    tokens = jnp.full((max_steps, num_rows), -1, jnp.int32)
    if features.num_logprobs is None:
        return SamplerOutput(tokens)
    width = 1 + features.num_logprobs
    return SamplerOutput(tokens, jnp.zeros((max_steps, num_rows, width), jnp.float32),
                         jnp.zeros((max_steps, num_rows, width), jnp.int32),
                         jnp.zeros((max_steps, num_rows), jnp.int32))


def _record(outs: SamplerOutput, step, out: SamplerOutput, sampled) -> SamplerOutput:
    """Store step `step`'s results in row `step` of the [K, R, ...] buffers (-1 tokens where a
    row sampled nothing). A step past the buffer (unrolling) is dropped."""
    k = outs.tokens.shape[0]
    at = jnp.where(step < k, step, k)

    def put(buf, value):
        return buf.at[at].set(value, mode="drop")

    tokens = put(outs.tokens, jnp.where(sampled, out.tokens, -1))
    if outs.logprobs is None:
        return SamplerOutput(tokens)
    return SamplerOutput(tokens, put(outs.logprobs, out.logprobs), put(outs.logprob_token_ids, out.logprob_token_ids),
                         put(outs.sampled_rank, out.sampled_rank))
