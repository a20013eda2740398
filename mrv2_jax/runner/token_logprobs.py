"""One token's logprobs as the runners hand them to the engine: the sampled (or next prompt)
token first, then the top n, with their raw logprobs and ranks.

Two forms with the same fields (`token_ids`, `logprobs`, `ranks`): `TokenLogprobs` holds lists,
`LogprobRow` only a reference to one row of its step's host arrays. The runners make rows: one
small object per token and nothing per logprob, where lists and `{token_id: Logprob}` dicts for
256 rows x 21 logprobs every step used to be the engine's critical path. A row's lists are made
when it is read, which for sample logprobs is when the user reads them (engine/lazy_logprobs.py).
"""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass
class TokenLogprobs:
    """Logprobs of one token (raw model logits): entry 0 is the sampled token, then the
    request's top n. `ranks[0]` is the sampled token's rank, the top n have ranks 1..n."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class LogprobBlock(NamedTuple):
    """The host logprob arrays of one step, one row per sampled token (a fused call's [K, R]
    flattened to K * R rows)."""

    values: np.ndarray  # f32[T, W]: column 0 = the sampled token, then the top logprobs
    token_ids: np.ndarray  # i32[T, W]
    sampled_rank: np.ndarray  # i32[T]: 1 + tokens with a larger raw logit

    @classmethod
    def of(cls, values, token_ids, sampled_rank) -> "LogprobBlock":
        """From arrays that may still be on the device ([..., W] and [...]): read to the host
        (copied already when the step started an async copy) and flattened to rows."""
        values = np.asarray(values)
        width = values.shape[-1]
        return cls(values.reshape(-1, width), np.asarray(token_ids).reshape(-1, width),
                   np.asarray(sampled_rank).reshape(-1))


class LogprobRow:
    """Row `row` of `block`, its first 1 + n columns: the sampled token, then the top n.

    Holds references only; the lists are built when read. It keeps the whole step's arrays
    alive, which is why a long-lived holder `detach`es old rows (engine/lazy_logprobs.py)."""

    __slots__ = ("block", "row", "n")

    def __init__(self, block: LogprobBlock, row: int, n: int):
        self.block, self.row, self.n = block, row, n

    @property
    def token_ids(self) -> list[int]:
        return self.block.token_ids[self.row, : 1 + self.n].tolist()

    @property
    def logprobs(self) -> list[float]:
        return self.block.values[self.row, : 1 + self.n].tolist()

    @property
    def ranks(self) -> list[int]:
        """The sampled token's rank, then 1..n (the top n are in order)."""
        return [int(self.block.sampled_rank[self.row]), *range(1, 1 + self.n)]

    def detach(self) -> TokenLogprobs:
        """The same values, owning nothing of the step's arrays."""
        return TokenLogprobs(self.token_ids, self.logprobs, self.ranks)

    def __repr__(self) -> str:
        return f"LogprobRow(token_ids={self.token_ids}, logprobs={self.logprobs}, ranks={self.ranks})"
