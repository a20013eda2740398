"""N-gram (prompt lookup) proposer, on the device from the persistent token table.

For each row: the longest n in [n_min, n_max] such that the row's last n tokens occur earlier
in its own tokens; at the latest such occurrence, the tokens that followed it are the drafts.
The continuation is read as periodic (period = distance from the match to the end), so a
short loop still yields k drafts. No match: the last token repeated (cheap to reject; the
step's shape is fixed, so a row always carries k drafts).

Cost per step: R x W x n_max comparisons over the rows' token tables (W = max_model_len + 1),
all elementwise; `propose_host` is the same rule in numpy (the V1 runner, and the tests'
reference).
"""

import jax.numpy as jnp
import numpy as np

from mrv2_jax.spec_decode.proposer import ProposeInputs, Proposer


class NgramProposer(Proposer):
    reads_token_table = True

    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, params, state, x: ProposeInputs):
        return state, ngram_drafts(x.token_rows, x.num_tokens, self.k, self.n_min, self.n_max), None

    def propose_host(self, token_rows, num_tokens):
        return np.stack([ngram_drafts_one(row[:n], self.k, self.n_min, self.n_max)
                         for row, n in zip(token_rows, num_tokens)]) if len(token_rows) else \
            np.zeros((0, self.k), np.int32)


def ngram_drafts(tokens, num_tokens, k: int, n_min: int, n_max: int):
    """tokens i32[R, W], num_tokens i32[R] -> drafts i32[R, k]."""
    r, w = tokens.shape
    length = num_tokens[:, None]
    i = jnp.arange(w)[None, :]  # candidate end of an earlier occurrence
    last = jnp.take_along_axis(tokens, jnp.maximum(length - 1, 0), axis=1)
    matched = (i < length - 1)  # ends strictly before the last token
    best_end = jnp.full((r,), -1, jnp.int32)
    for m in range(n_max):  # matched[:, i]: tokens[i - m'] == tokens[L - 1 - m'] for all m' <= m
        shifted = jnp.pad(tokens, ((0, 0), (m, 0)), constant_values=-1)[:, :w]  # shifted[i] = tokens[i - m]
        target = jnp.take_along_axis(tokens, jnp.maximum(length - 1 - m, 0), axis=1)
        matched = matched & (shifted == target) & (i >= m) & (length - 1 - m >= 0)
        n = m + 1
        if n >= n_min:
            end = jnp.max(jnp.where(matched, i, -1), axis=1).astype(jnp.int32)
            best_end = jnp.where(end >= 0, end, best_end)  # longer n overrides shorter
    period = jnp.maximum(num_tokens - 1 - best_end, 1)
    j = jnp.arange(k)[None, :]
    index = best_end[:, None] + 1 + j % period[:, None]
    drafts = jnp.take_along_axis(tokens, jnp.clip(index, 0, w - 1), axis=1)
    return jnp.where(best_end[:, None] >= 0, drafts, last).astype(jnp.int32)


def ngram_drafts_one(tokens, k: int, n_min: int, n_max: int) -> np.ndarray:
    """The same rule for one row of known tokens, in plain Python/numpy."""
    tokens = [int(t) for t in tokens]
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 2, n - 2, -1):  # latest occurrence first
            if tokens[end - n + 1 : end + 1] == suffix:
                period = length - 1 - end
                return np.array([tokens[end + 1 + j % period] for j in range(k)], np.int32)
    return np.full(k, tokens[-1] if tokens else 0, np.int32)
