"""`SpecDecoder`: what speculative decoding adds to a runner's compiled step.

A runner with spec decode keeps two extra arguments of its step: the proposer's weights
(`params`, not donated) and `state` (donated): the proposer's own state (a draft KV cache) and,
for probabilistic verification with a draft model, the per-slot table of draft distributions
`[max_num_seqs, k, V]` that the next step's verification reads.

V2 (`v2_step`): the tables say how many drafts each row carries; after verification the
accepted tokens go into the slot tables, the proposer drafts from the new last token and its
drafts go into the token table right after it, where the next step's input preparation reads
them. The host sees only the sampled tokens and their count, one step later.
V1 (`v1_step`): the same verification; the drafts are returned to the host, which puts them
in the next step's input ids (n-gram drafts are computed on the host there).
Both runners also pass `next_prompt_token` (for each row still prefilling, the prompt token
after this step's chunk), which the MTP proposer's catch-up reads.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mrv2_jax.sample import slot_state
from mrv2_jax.spec_decode import verify
from mrv2_jax.spec_decode.config import SpeculativeConfig
from mrv2_jax.spec_decode.proposer import ProposeInputs, Proposer


class SpecState(NamedTuple):
    proposer: object  # the proposer's own device state (pytree; () when none)
    draft_probs: jax.Array | None  # f32[S, k, V] or None


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, *, num_slots: int, vocab_size: int):
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self.num_slots, self.vocab_size = num_slots, vocab_size
        self.keeps_draft_probs = config.rejection_sampling == "probabilistic" and proposer.returns_probs

    @property
    def num_lookahead_tokens(self) -> int:
        return self.proposer.num_lookahead_tokens

    def init_params(self):
        return self.proposer.init_params()

    def init_state(self) -> SpecState:
        probs = jnp.zeros((self.num_slots, self.k, self.vocab_size), jnp.float32) if self.keeps_draft_probs else None
        return SpecState(self.proposer.init_state(), probs)

    def _verify(self, lm, hidden, inputs, num_draft, sampling, features, penalties, slots, state: SpecState):
        draft_probs = None if state.draft_probs is None else state.draft_probs[jnp.maximum(slots, 0)]
        return verify.sample_and_verify(
            lm, hidden, input_ids=inputs.input_ids, positions=inputs.positions,
            query_start_loc=inputs.query_start_loc, num_draft=num_draft, sampling=sampling, features=features,
            penalties=penalties, config=self.config, draft_probs=draft_probs)

    def _propose(self, params, state: SpecState, inputs, out, num_draft, sampling, samples, num_reqs,
                 hidden, slots, token_rows, num_tokens, next_prompt_token=None):
        if self.proposer.reads_token_table and token_rows is None:  # V1: drafted on the host
            return state, jnp.zeros((num_draft.shape[0], self.k), jnp.int32)
        first = inputs.seq_lens - num_draft
        x = ProposeInputs(
            input_ids=inputs.input_ids, positions=inputs.positions, slot_mapping=inputs.slot_mapping,
            query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens, block_tables=inputs.block_tables,
            num_reqs=num_reqs, hidden=hidden, samples=samples,
            last_token=jnp.take_along_axis(out.tokens, out.num_accepted[:, None], axis=1)[:, 0],
            last_position=first + out.num_accepted, temperature=sampling.temperature, seeds=sampling.seeds,
            token_rows=token_rows, num_tokens=num_tokens, next_prompt_token=next_prompt_token)
        proposer_state, drafts, probs = self.proposer.propose(params, state.proposer, x)
        table = state.draft_probs
        if table is not None:
            rows = jnp.where(samples, slots, self.num_slots)
            table = table.at[rows].set(probs, mode="drop")
        return SpecState(proposer_state, table), drafts

    def v2_step(self, lm, params, state: SpecState, kv_cache, dstate, sampler_state, *, idx_mapping, num_reqs,
                inputs, attention, sampling, sampler_rows, penalties, features, next_prompt_token=None):
        """The V2 step after input preparation -> (kv_cache, dstate, sampler_state, state, out)."""
        num_draft = verify.num_drafts_of_rows(dstate, idx_mapping, inputs, self.k)
        hidden, kv_cache = lm(inputs.input_ids, inputs.positions, attention, kv_cache)
        out = self._verify(lm, hidden, inputs, num_draft, sampling, features, penalties, idx_mapping, state)
        if features.penalties:  # rows with penalties carry no drafts: their token is index 0
            sampler_state = slot_state.count_sampled(
                sampler_state, jnp.where(inputs.samples, sampler_rows, -1), out.tokens[:, 0])
        dstate = verify.post_update(dstate, idx_mapping, num_reqs, inputs, out, num_draft)
        num_tokens = dstate.num_tokens[idx_mapping]
        token_rows = dstate.token_ids[idx_mapping] if self.proposer.reads_token_table else None
        state, drafts = self._propose(params, state, inputs, out, num_draft, sampling, inputs.samples, num_reqs,
                                      hidden, idx_mapping, token_rows, num_tokens, next_prompt_token)
        # Drafts go right after the newest token, where the next step reads its inputs.
        s = dstate.token_ids.shape[0]
        rows = jnp.where(inputs.samples, idx_mapping, s)[:, None]
        cols = num_tokens[:, None] + jnp.arange(self.k)[None, :]
        dstate = dstate._replace(token_ids=dstate.token_ids.at[rows, cols].set(drafts, mode="drop"))
        return kv_cache, dstate, sampler_state, state, out

    def v1_step(self, lm, params, state: SpecState, kv_cache, sampler_state, *, inputs, num_draft, samples, slots,
                num_reqs, attention, sampling, table_rows, features, penalties, next_prompt_token=None):
        """The V1 step -> (kv_cache, sampler_state, state, out, drafts i32[R, k])."""
        hidden, kv_cache = lm(inputs.input_ids, inputs.positions, attention, kv_cache)
        out = self._verify(lm, hidden, inputs, num_draft, sampling, features, penalties, slots, state)
        if features.penalties:
            sampler_state = slot_state.count_sampled(sampler_state, jnp.where(samples, table_rows, -1),
                                                     out.tokens[:, 0])
        state, drafts = self._propose(params, state, inputs, out, num_draft, sampling, samples, num_reqs, hidden,
                                      slots, None, None, next_prompt_token)
        return kv_cache, sampler_state, state, out, drafts
