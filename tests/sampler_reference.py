"""An independent numpy (float64) reference of the sampler's semantics, one row at a time,
written from vLLM's definitions rather than from the device code."""

import numpy as np


def process_row(logits, *, bias=None, stop_ids=(), min_tokens=0, num_output=0, prompt=(), output=(),
                rep=1.0, pres=0.0, freq=0.0):
    """logit_bias -> min_tokens mask -> repetition / presence / frequency penalties."""
    x = np.asarray(logits, np.float64).copy()
    for token_id, b in (bias or {}).items():
        x[token_id] += b
    if num_output < min_tokens:
        x[list(stop_ids)] = -np.inf
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x))
    seen = counts > 0
    seen[list(prompt)] = True
    with np.errstate(invalid="ignore"):
        x = np.where(seen & (x > 0), x / rep, np.where(seen & (x <= 0), x * rep, x))
    return x - freq * counts - pres * (counts > 0)


def kept_tokens(scaled, *, min_p=0.0, top_k=0, top_p=1.0):
    """bool[V]: tokens that survive min_p, then top_k, then top_p (ties kept together)."""
    s = np.asarray(scaled, np.float64)
    keep = np.ones(len(s), bool)
    m = s.max()
    if min_p > 0:
        keep &= s >= m + np.log(min_p)
    if 0 < top_k < len(s):
        keep &= s >= np.sort(s)[::-1][top_k - 1]
    if top_p < 1:
        probs = np.where(keep, np.exp(s - m), 0.0)
        probs /= probs.sum()
        mass_above = np.array([probs[s > v].sum() for v in s])
        keep &= mass_above < top_p
    return keep


def distribution(scaled, keep):
    s = np.asarray(scaled, np.float64)
    p = np.where(keep, np.exp(s - s[keep].max()), 0.0)
    return p / p.sum()


def log_softmax(logits):
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def safe_top_p(scaled, keep, rng):
    """A top_p value halfway between two consecutive cumulative masses of the kept tokens, so
    f32 and f64 agree on where the cut falls."""
    s = np.asarray(scaled, np.float64)
    probs = np.sort(np.where(keep, np.exp(s - s.max()), 0.0))[::-1]
    cum = np.cumsum(probs / probs.sum())
    n = int(keep.sum())
    if n < 2:
        return 0.5
    j = int(rng.integers(0, min(n - 1, 20)))
    return float((cum[j] + cum[j + 1]) / 2) if cum[j + 1] - cum[j] > 1e-4 else 1.0
