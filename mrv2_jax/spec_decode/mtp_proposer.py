"""MTP proposer: the target's own multi-token-prediction layer drafts k tokens, inside the
target's compiled step (DeepSeek-V3 / GLM-4.5 MTP, driven the way vLLM drives it).

The MTP layer at position i reads the embedding of token i + 1 and the target's final hidden
state at i; its logits (the target's shared `compute_logits`) predict token i + 2. It is one
attention layer with its own paged KV cache: same block size and block count as the target's,
indexed by the target's block tables and slot mapping (like the draft model's cache). Per step:
  1. catch-up: the layer runs over this step's flattened tokens with each row's ids shifted
     left by one (the next token). For a sampling row the position whose target hidden
     produced the row's newest token (`last_position - 1`) gets that token, so its KV is right
     even when the target rejected the draft that was there; positions after it held rejected
     drafts and are stale (overwritten by the next steps before anything reads them). The last
     token of a row still prefilling gets the prompt token after its chunk
     (`ProposeInputs.next_prompt_token`), or writes nothing where that is unknown;
  2. the first draft is sampled from the layer's output at `last_position - 1`;
  3. drafts 2..k (a lax.scan): one token per row, the previous draft's embedding and the
     layer's own output (before its final norm) as the "previous hidden state", KV written at
     `last_position + j - 1`; the next step's catch-up rewrites those positions with the
     target's hidden states. Every draft reuses depth 0, as vLLM does (a checkpoint with more
     MTP layers still drafts with the first).
Drafts are sampled with the request's temperature and its (seed, position) Gumbel noise (as the
draft model's are). Step 3 writes KV up to k - 2 positions past the row's newest token.
Prefix caching: a cached block's MTP KV is the one its first owner computed; at the last
position before the first uncached token that owner's next token may differ from this
request's, which can only cost acceptance (strict verification keeps outputs exact).
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.runner.model_step import FlatParams
from mrv2_jax.sample.sampler import sample_tokens
from mrv2_jax.spec_decode.proposer import (
    ProposeInputs,
    Proposer,
    draft_distribution,
    one_token_layout,
)

DEPTH = 0  # every draft runs the first MTP layer


@dataclass(frozen=True)
class _ShiftedLayer:
    """The attention backend with the layer index moved to the proposer's own cache.

    `forward_mtp` gives attention the MTP layer's global index (`num_layers + depth`, its place
    after the decoder layers, as in the checkpoint). The proposer's cache holds that one layer
    only ([1, num_blocks, ...]: allocating num_layers + 1 layers would waste the whole target's
    KV size), so the index is shifted to 0 here. Without the shift the jnp KV write would drop
    every write silently (an out-of-range layer with mode="drop")."""

    inner: PagedAttention
    first_layer: int

    def __call__(self, q, k, v, layer, kv_cache, scale):
        return self.inner(q, k, v, layer - self.first_layer, kv_cache, scale)

    def attend_qkv(self, qkv, heads, norm_rope, layer, kv_cache, scale, shards=1):
        return self.inner.attend_qkv(qkv, heads, norm_rope, layer - self.first_layer, kv_cache, scale, shards)


class MtpProposer(Proposer):
    def __init__(self, model_state, lm, k: int, *, num_blocks: int, block_size: int, max_model_len: int,
                 kv_dtype, use_kernels: bool, with_probs: bool = False):
        if not model_state.has_mtp:
            raise ValueError(f"{type(model_state).__name__} has no MTP layer")
        self.k = k
        # Step 3 writes KV at last_position .. last_position + k - 2; the scheduled tokens end
        # at last_position - 1 at the earliest (all of a row's drafts rejected).
        self.num_lookahead_tokens = max(k - 1, 0)
        self.returns_probs = with_probs
        self.model_state = model_state
        # The MTP layer, the embeddings and the LM head are the target's own weights: the step
        # gets the same buffers a second time (not copied).
        self.params = FlatParams(lm)
        self.layer = model_state.mtp_group().layers[DEPTH]
        self.num_blocks, self.block_size, self.kv_dtype = num_blocks, block_size, kv_dtype
        self.max_model_len, self.use_kernels = max_model_len, use_kernels

    def init_params(self):
        return self.params.leaves

    def init_state(self):
        """(k_cache, v_cache), each [1, num_blocks, num_kv_heads, block_size, head_dim]."""
        shape = (1, *self.model_state.kv_cache_shape(self.num_blocks, self.block_size)[1:])
        return jnp.zeros(shape, self.kv_dtype), jnp.zeros(shape, self.kv_dtype)

    def _attention(self, slot_mapping, block_tables, seq_lens, query_start_loc, num_reqs):
        return _ShiftedLayer(PagedAttention(slot_mapping, block_tables, seq_lens, query_start_loc, num_reqs,
                                            use_kernels=self.use_kernels), self.layer)

    def _probs(self, logits, draft, x: ProposeInputs):
        return draft_distribution(logits, draft, x.temperature) if self.returns_probs else None

    def catch_up_ids(self, x: ProposeInputs):
        """-> (i32[T] the next token of each scheduled token, i32[T] its slot or -1)."""
        t, r = x.input_ids.shape[0], x.last_token.shape[0]
        qsl = x.query_start_loc
        index = jnp.arange(t, dtype=jnp.int32)
        row = jnp.minimum(jnp.searchsorted(qsl[1:], index, side="right", method="scan_unrolled"), r - 1)
        is_last = index == qsl[row + 1] - 1
        following = jnp.concatenate([x.input_ids[1:], x.input_ids[:1]])
        next_prompt = (jnp.full((r,), -1, jnp.int32) if x.next_prompt_token is None
                       else x.next_prompt_token.astype(jnp.int32))
        newest = x.samples[row] & (x.positions == x.last_position[row] - 1)
        unknown = is_last & ~newest & (next_prompt[row] < 0)
        ids = jnp.where(newest, x.last_token[row], jnp.where(is_last, next_prompt[row], following))
        return jnp.where(unknown, 0, ids), jnp.where(unknown, -1, x.slot_mapping)

    def propose(self, params, cache, x: ProposeInputs):
        lm = self.params.merge(params)
        ids, slots = self.catch_up_ids(x)
        attention = self._attention(slots, x.block_tables, x.seq_lens, x.query_start_loc, x.num_reqs)
        hidden, pre_norm, cache = lm.forward_mtp(DEPTH, ids, x.hidden, x.positions, attention, cache,
                                                 return_pre_norm=True)
        # Flattened index of each row's position last_position - 1 (its last scheduled token
        # sits at seq_lens - 1).
        t = x.input_ids.shape[0]
        newest = jnp.clip(x.query_start_loc[1:] - 1 - x.seq_lens + x.last_position, 0, t - 1)
        logits = lm.compute_logits(hidden[newest])
        first = sample_tokens(logits, x.temperature, x.seeds, x.last_position + 1)
        first_probs = self._probs(logits, first, x)
        if self.k == 1:
            probs = None if first_probs is None else first_probs[:, None]
            return cache, first[:, None], probs

        def draft_one(carry, j):
            cache, token, prev = carry
            # This MTP step's KV position is last_position + j - 1; its draft lands 2 later.
            pos, slots, seq_lens, rows = one_token_layout(x, x.last_position + j - 1, self.block_size,
                                                          self.max_model_len)
            attention = self._attention(slots, x.block_tables, seq_lens, rows, x.num_reqs)
            hidden, pre_norm, cache = lm.forward_mtp(DEPTH, token, prev, pos, attention, cache,
                                                     return_pre_norm=True)
            logits = lm.compute_logits(hidden)
            draft = sample_tokens(logits, x.temperature, x.seeds, pos + 2)
            return (cache, draft, pre_norm), (draft, self._probs(logits, draft, x))

        (cache, _, _), (drafts, probs) = jax.lax.scan(
            draft_one, (cache, first, pre_norm[newest]), jnp.arange(1, self.k, dtype=jnp.int32))
        drafts = jnp.concatenate([first[:, None], drafts.T], axis=1)
        if probs is not None:
            probs = jnp.concatenate([first_probs[:, None], jnp.swapaxes(probs, 0, 1)], axis=1)
        return cache, drafts, probs
