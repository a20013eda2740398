"""The sampler's per-batch input, and the host-side helpers that build it from SamplingParams.

`SamplingTensors` holds one row per batch row (R rows, padded rows carry neutral values, so a
padded row never switches a feature on). Neutral means: temperature 0 (greedy), top_k 0,
top_p 1, min_p 0, repetition 1, presence/frequency 0, min_tokens 0, no bias, no stop ids,
num_logprobs -1. Penalty data ([R, V] counts and prompt masks) travels separately, in
`penalties.PenaltyData`, because runners keep it in persistent per-slot device tables.

Host side: `sampling_row` turns one request's SamplingParams into the values of its row, and
`SamplingTable` keeps those rows per slot in numpy (the runner's persistent CPU tables) and
gathers a batch of them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.config import MAX_LOGIT_BIAS, MAX_STOP_IDS
from mrv2_jax.sample.features import SamplerFeatures
from mrv2_jax.sampling_params import SamplingParams


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingTensors:
    temperature: jax.Array  # f32[R]; 0 = greedy
    top_k: jax.Array  # i32[R]; 0 (or >= vocab) = off
    top_p: jax.Array  # f32[R]; 1 = off
    min_p: jax.Array  # f32[R]; 0 = off
    seeds: jax.Array  # i32[R]; Gumbel noise key (with the position of the sampled token)
    repetition_penalty: jax.Array  # f32[R]; 1 = off
    presence_penalty: jax.Array  # f32[R]; 0 = off
    frequency_penalty: jax.Array  # f32[R]; 0 = off
    min_tokens: jax.Array  # i32[R]
    num_output_tokens: jax.Array  # i32[R]: outputs that exist before the token sampled now
    num_logprobs: jax.Array  # i32[R]; -1 = no logprobs, n >= 0 = sampled token + top n
    automaton_state: jax.Array  # i32[R]; structured outputs: the row's global automaton state, -1 = none
    bias_ids: jax.Array  # i32[R, MB]; -1 = padding
    bias_values: jax.Array  # f32[R, MB]
    stop_ids: jax.Array  # i32[R, MS]; -1 = padding; masked while num_output < min_tokens

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def neutral(cls, num_rows: int, max_bias: int = MAX_LOGIT_BIAS, max_stop: int = MAX_STOP_IDS,
                xp=np) -> SamplingTensors:
        """Rows that use no feature (greedy). `xp` = np (host) or jnp (device)."""
        return cls(**{name: xp.asarray(value) for name, value in
                      _neutral_arrays(num_rows, max_bias, max_stop).items()})

    def to_device(self) -> SamplingTensors:
        return jax.tree.map(jnp.asarray, self)


_SCALAR_DEFAULTS = {  # field -> (dtype, neutral value)
    "temperature": (np.float32, 0.0), "top_k": (np.int32, 0), "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0), "seeds": (np.int32, 0), "repetition_penalty": (np.float32, 1.0),
    "presence_penalty": (np.float32, 0.0), "frequency_penalty": (np.float32, 0.0),
    "min_tokens": (np.int32, 0), "num_output_tokens": (np.int32, 0), "num_logprobs": (np.int32, -1),
    "automaton_state": (np.int32, -1),
}
SCALAR_FIELDS = tuple(_SCALAR_DEFAULTS)
FLOAT_SCALAR_FIELDS = frozenset(n for n, (dt, _) in _SCALAR_DEFAULTS.items() if dt == np.float32)


def _neutral_arrays(num_rows: int, max_bias: int, max_stop: int) -> dict[str, np.ndarray]:
    out = {name: np.full(num_rows, value, dtype) for name, (dtype, value) in _SCALAR_DEFAULTS.items()}
    out["bias_ids"] = np.full((num_rows, max_bias), -1, np.int32)
    out["bias_values"] = np.zeros((num_rows, max_bias), np.float32)
    out["stop_ids"] = np.full((num_rows, max_stop), -1, np.int32)
    return out


# ------------------------------------------------------------------------------------------
# Host side: one request -> one row
# ------------------------------------------------------------------------------------------


@dataclass
class SamplingRow:
    """The sampler values of one request (num_output_tokens is not here: it changes per step)."""

    scalars: dict[str, float | int]
    bias_ids: np.ndarray  # i32[num_bias]
    bias_values: np.ndarray  # f32[num_bias]
    stop_ids: np.ndarray  # i32[num_stop]; empty unless min_tokens > 0

    @property
    def uses_penalties(self) -> bool:
        s = self.scalars
        return s["repetition_penalty"] != 1.0 or s["presence_penalty"] != 0.0 or s["frequency_penalty"] != 0.0

    @property
    def uses_sparse(self) -> bool:
        """Has logit-bias entries or min_tokens stop ids (per-slot sparse lists)."""
        return len(self.bias_ids) > 0 or len(self.stop_ids) > 0


def is_plain_greedy(row: SamplingRow) -> bool:
    """An argmax of the raw logits serves this row: greedy, and nothing that changes logits
    before the argmax (bias, min_tokens, penalties, an automaton's mask) or asks for logprobs. top_k / top_p / min_p
    never remove the largest logit, so they do not matter for a greedy row."""
    s = row.scalars
    return (s["temperature"] == 0 and not row.uses_penalties and not row.uses_sparse and s["num_logprobs"] < 0
            and s["automaton_state"] < 0)


def row_needs(row: SamplingRow, vocab_size: int) -> SamplerFeatures:
    """The features one request's row needs (the one-row case of `needed_features`). A greedy
    row needs no truncation: min_p / top_k / top_p never remove the largest logit."""
    s = row.scalars
    sampled = s["temperature"] > 0
    return SamplerFeatures(
        sampling=sampled, logit_bias=len(row.bias_ids) > 0, min_tokens=len(row.stop_ids) > 0,
        penalties=row.uses_penalties, min_p=sampled and s["min_p"] > 0,
        top_k=sampled and 0 < s["top_k"] < vocab_size, top_p=sampled and s["top_p"] < 1,
        num_logprobs=None if s["num_logprobs"] < 0 else int(s["num_logprobs"]),
        structured=s["automaton_state"] >= 0, runtime_skip=False)


def seed_to_int32(seed: int) -> int:
    """Any Python int -> int32 whose uint32 view is seed mod 2**32 (what the noise keys use), so
    seeds in [0, 2**31) keep the exact noise they always had."""
    return int(np.uint32(seed % 2**32).view(np.int32))


def sampling_row(params: SamplingParams, *, eos_token_ids=(), seed_rng: np.random.Generator | None = None,
                 ) -> SamplingRow:
    """The row values of one request. Unseeded sampled requests get a random seed from
    `seed_rng`; greedy ones need none."""
    greedy = params.is_greedy
    seed = params.seed
    if seed is None:
        seed = 0 if greedy or seed_rng is None else int(seed_rng.integers(2**31))
    scalars = {
        "temperature": 0.0 if greedy else params.temperature,
        "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
        "seeds": seed_to_int32(seed),
        "repetition_penalty": params.repetition_penalty, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty, "min_tokens": params.min_tokens,
        "num_logprobs": -1 if params.logprobs is None else params.logprobs,
        "automaton_state": -1,  # the runner sets a constrained request's start state
    }
    bias = params.logit_bias or {}
    stop = []
    if params.min_tokens > 0:
        # vLLM masks every id that would end the request: stop_token_ids, and EOS unless ignored.
        stop = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))
    return SamplingRow(scalars, np.fromiter(bias.keys(), np.int32, len(bias)),
                       np.fromiter(bias.values(), np.float32, len(bias)), np.asarray(stop, np.int32))


def needed_features(tensors: SamplingTensors, vocab_size: int) -> SamplerFeatures:
    """The smallest static feature set that serves a batch (host numpy rows), with runtime skips
    off (a variant picked this way has no feature its batch does not use)."""
    t = tensors
    num_lp = int(np.max(t.num_logprobs, initial=-1))
    return SamplerFeatures(
        sampling=bool(np.any(t.temperature > 0)),
        logit_bias=bool(np.any(t.bias_ids >= 0)),
        min_tokens=bool(np.any((t.num_output_tokens < t.min_tokens)[:, None] & (t.stop_ids >= 0))),
        penalties=bool(np.any((t.repetition_penalty != 1) | (t.presence_penalty != 0)
                              | (t.frequency_penalty != 0))),
        min_p=bool(np.any(t.min_p > 0)),
        top_k=bool(np.any((t.top_k > 0) & (t.top_k < vocab_size))),
        top_p=bool(np.any(t.top_p < 1)),
        num_logprobs=None if num_lp < 0 else num_lp,
        structured=bool(np.any(t.automaton_state >= 0)),
        runtime_skip=False)


class SamplingTable:
    """Persistent per-slot sampler rows on the host (numpy), as a runner keeps them."""

    def __init__(self, num_slots: int, max_bias: int = MAX_LOGIT_BIAS, max_stop: int = MAX_STOP_IDS):
        self.arrays = _neutral_arrays(num_slots, max_bias, max_stop)
        self.uses_penalties = np.zeros(num_slots, bool)
        self.uses_sparse = np.zeros(num_slots, bool)

    def write(self, slot: int, row: SamplingRow, num_output_tokens: int = 0) -> None:
        a = self.arrays
        for name, value in row.scalars.items():
            a[name][slot] = value
        a["num_output_tokens"][slot] = num_output_tokens
        a["bias_ids"][slot] = -1
        a["bias_values"][slot] = 0
        a["stop_ids"][slot] = -1
        # Longer lists were rejected when the request was added (check_request_fits); cut them
        # here too rather than let one request stop the engine.
        mb, ms = a["bias_ids"].shape[1], a["stop_ids"].shape[1]
        a["bias_ids"][slot, : min(len(row.bias_ids), mb)] = row.bias_ids[:mb]
        a["bias_values"][slot, : min(len(row.bias_values), mb)] = row.bias_values[:mb]
        a["stop_ids"][slot, : min(len(row.stop_ids), ms)] = row.stop_ids[:ms]
        self.uses_penalties[slot] = row.uses_penalties
        self.uses_sparse[slot] = row.uses_sparse

    def gather_scalars(self, slots: np.ndarray, num_rows: int) -> dict[str, np.ndarray]:
        """The per-row scalar fields of `slots`, padded with neutral rows to `num_rows`."""
        out = {}
        for name, (dtype, neutral) in _SCALAR_DEFAULTS.items():
            out[name] = np.full(num_rows, neutral, dtype)
            out[name][: len(slots)] = self.arrays[name][slots]
        return out

    def gather(self, slots: np.ndarray, num_rows: int) -> SamplingTensors:
        """The batch rows of `slots`, padded with neutral rows to `num_rows` (numpy)."""
        a, n = self.arrays, len(slots)
        out = _neutral_arrays(num_rows, a["bias_ids"].shape[1], a["stop_ids"].shape[1])
        for f in fields(SamplingTensors):
            out[f.name][:n] = a[f.name][slots]
        return SamplingTensors(**out)
