"""Draft-model proposer: a smaller model with the target's tokenizer drafts k tokens, inside
the target's compiled step.

Its paged KV cache has the target's block size and block count, so it shares the target's
block tables: a request's draft KV lives in the same block ids as its target KV, in its own
arrays. Per step:
  1. catch-up: the draft runs over this step's flattened target tokens (same positions, slot
     mapping and metadata), so its cache holds every token the target computed; drafts the
     target rejected leave stale entries beyond the row's new end, which later steps overwrite
     before anything reads them (attention never reads past seq_lens);
  2. k decode steps (a lax.scan): from each sampling row's newest token, one token per step,
     sampled with the request's temperature and its (seed, position) Gumbel noise, the same
     noise the target's sampler uses at that position, so strict verification accepts
     whenever the two models agree.
Step 2 writes KV up to k - 1 positions past the row's newest token: the scheduler keeps
`num_lookahead_tokens` extra slots allocated for that.
"""

import jax
import jax.numpy as jnp

from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.runner.kv_cache import allocate_kv_cache
from mrv2_jax.runner.model_step import FlatParams
from mrv2_jax.sample.sampler import sample_tokens
from mrv2_jax.spec_decode.proposer import (
    ProposeInputs,
    Proposer,
    draft_distribution,
    one_token_layout,
)


class DraftModelProposer(Proposer):
    def __init__(self, model_state, lm, k: int, *, num_blocks: int, block_size: int, max_model_len: int,
                 kv_dtype, use_kernels: bool, with_probs: bool):
        self.k = k
        self.num_lookahead_tokens = k
        self.returns_probs = with_probs
        self.model_state = model_state
        self.params = FlatParams(lm)
        self.num_blocks, self.block_size, self.kv_dtype = num_blocks, block_size, kv_dtype
        self.max_model_len, self.use_kernels = max_model_len, use_kernels

    def init_params(self):
        return self.params.leaves

    def init_state(self):
        return allocate_kv_cache(self.model_state, self.num_blocks, self.block_size, self.kv_dtype)

    def propose(self, params, cache, x: ProposeInputs):
        lm = self.params.merge(params)
        catch_up = PagedAttention(x.slot_mapping, x.block_tables, x.seq_lens, x.query_start_loc, x.num_reqs,
                                  use_kernels=self.use_kernels)
        _, cache = lm(x.input_ids, x.positions, catch_up, cache)

        def draft_one(carry, j):
            cache, token = carry
            pos, slots, seq_lens, rows = one_token_layout(x, x.last_position + j, self.block_size, self.max_model_len)
            attention = PagedAttention(slots, x.block_tables, seq_lens, rows, x.num_reqs, use_kernels=self.use_kernels)
            hidden, cache = lm(token, pos, attention, cache)
            logits = lm.compute_logits(hidden)
            draft = sample_tokens(logits, x.temperature, x.seeds, pos + 1)
            probs = draft_distribution(logits, draft, x.temperature) if self.returns_probs else None
            return (cache, draft), (draft, probs)

        (cache, _), (drafts, probs) = jax.lax.scan(draft_one, (cache, x.last_token), jnp.arange(self.k))
        probs = None if probs is None else jnp.swapaxes(probs, 0, 1)
        return cache, drafts.T, probs
