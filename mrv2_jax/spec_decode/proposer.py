"""The proposer interface: what every way of drafting tokens provides to the runners.

A proposer runs inside the compiled step, right after verification, for every batch row that
sampled this step, and drafts the k tokens that follow the row's new last token. The drafts
stay on the device (V2 writes them into the slot's token table, where the next step's input
preparation reads them like any other token); nothing goes through the host.

`propose(params, state, x) -> (state, drafts i32[R, k], draft_probs f32[R, k, V] | None)`:
`params` are the proposer's weights (`()` when it has none), passed to the step like the
target's; `state` is its persistent device state (the draft model's KV cache; `()` when it has
none), donated with the step. `draft_probs` is the distribution each draft was sampled from
(probabilistic rejection needs it); None means the drafts are deterministic (one-hot q).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ProposeInputs(NamedTuple):
    # This step's flattened target layout (a draft model catches up on these tokens).
    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]
    query_start_loc: jax.Array  # i32[R + 1]
    seq_lens: jax.Array  # i32[R]
    block_tables: jax.Array  # i32[R, max_blocks_per_seq]
    num_reqs: jax.Array  # i32[]
    hidden: jax.Array  # [T, H] the target's final hidden states (MTP heads read them)
    # Per batch row, after verification:
    samples: jax.Array  # bool[R]: the row sampled this step (only these rows need drafts)
    last_token: jax.Array  # i32[R]: the row's newest token
    last_position: jax.Array  # i32[R]: its position
    temperature: jax.Array  # f32[R]
    seeds: jax.Array  # i32[R]
    token_rows: jax.Array | None  # i32[R, W]: the rows' token tables (V2), None in V1
    num_tokens: jax.Array  # i32[R]: tokens known per row, the newest included
    # Rows still prefilling (they do not sample): the prompt token right after this step's
    # chunk, -1 where there is none (MTP's catch-up reads it); None when the runner gives none.
    next_prompt_token: jax.Array | None = None  # i32[R]


def one_token_layout(x: ProposeInputs, pos: jax.Array, block_size: int, max_model_len: int):
    """The attention layout of a draft step that feeds one token per row at positions `pos`
    i32[R] -> (positions, slot_mapping, seq_lens, query_start_loc). Rows that do not sample,
    and positions past the model's length, attend to one harmless entry (position 0) and write
    nothing (slot -1); their drafts are never used."""
    writes = x.samples & (pos < max_model_len)
    pos = jnp.where(writes, pos, 0)
    max_blocks = x.block_tables.shape[1]
    block = jnp.take_along_axis(x.block_tables, jnp.clip(pos // block_size, 0, max_blocks - 1)[:, None], 1)[:, 0]
    slots = jnp.where(writes, block * block_size + pos % block_size, -1)
    return pos, slots, pos + 1, jnp.arange(pos.shape[0] + 1, dtype=jnp.int32)


def draft_distribution(logits: jax.Array, draft: jax.Array, temperature: jax.Array) -> jax.Array:
    """f32[R, V]: the distribution a draft was sampled from (probabilistic rejection's q):
    softmax(logits / T), one-hot on the draft for greedy rows."""
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    return jnp.where(greedy[:, None], jax.nn.one_hot(draft, logits.shape[-1]), jax.nn.softmax(scaled))


class Proposer:
    k: int
    # Writes KV beyond the scheduled tokens (the draft's own positions): the scheduler keeps
    # this many extra slots allocated per request.
    num_lookahead_tokens: int = 0
    # Needs `token_rows` (V2's device token table); V1 calls `propose_host` instead.
    reads_token_table: bool = False
    returns_probs: bool = False

    def init_params(self):
        return ()

    def init_state(self):
        return ()

    def propose(self, params, state, x: ProposeInputs):
        raise NotImplementedError

    def propose_host(self, token_rows, num_tokens):
        """V1 only, for proposers that read the token table: numpy [R, W], [R] -> [R, k]."""
        raise NotImplementedError(f"{type(self).__name__} has no host implementation")


class SyntheticProposer(Proposer):
    """Drafts that cost nothing (the last token, repeated); with synthetic verification each is
    accepted with a fixed probability, whatever its value."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, params, state, x: ProposeInputs):
        return state, jnp.repeat(x.last_token[:, None], self.k, axis=1), None
