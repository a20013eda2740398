"""Verifying drafts on the device: how many of a row's drafts to keep, and its output tokens.

Row r of a spec step carries `num_draft[r]` drafts d_1..d_n (0 <= n <= k) after its last
known token; the target model has scored positions j = 0..n, and `target_tokens[r, j]` is what
the target's own sampler picks at j (Gumbel noise keyed by (seed, position), as without
speculation). A row outputs its accepted drafts and then one more token: the target's pick at
the first rejected position, or the bonus token after the last draft when all were accepted.
So every row emits 1..n+1 tokens: `tokens[r, :num_accepted[r] + 1]`.

* strict: accept d_j while it equals the target's pick at j - 1. The outputs are exactly the
  target's own samples, token for token (greedy: identical to no speculation; seeded sampling:
  identical too, since the noise depends only on (seed, position)). A draft sampled with the same
  noise (the draft model does) agrees often when the two distributions are close.
* probabilistic: the classic test. Accept d_j with probability min(1, p(d_j) / q(d_j)); at the
  first rejection sample from the residual max(0, p - q) (normalised). The output distribution
  is p, whatever q is. q = None means deterministic drafts (n-gram): q is one-hot at d_j.
  The uniforms and the residual noise use their own streams of the (seed, position) key, so
  they are independent of the Gumbel noise the draft was sampled with.
* synthetic: accept each draft with a fixed probability (benchmarks), keep the drafts.
"""

import jax
import jax.numpy as jnp

_UNIFORM_STREAM, _RESIDUAL_STREAM, _SYNTHETIC_STREAM = 1, 2, 3


def _stream_key(seed, position, stream: int):
    key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), position)
    return jax.random.fold_in(key, stream)


def keyed_uniform(seeds, positions, stream: int) -> jax.Array:
    """f32 uniform in [0, 1) per (seed, position) entry; seeds broadcast against positions."""
    seeds = jnp.broadcast_to(seeds, positions.shape)
    flat = jax.vmap(lambda s, p: jax.random.uniform(_stream_key(s, p, stream)))(seeds.ravel(), positions.ravel())
    return flat.reshape(positions.shape)


def keyed_gumbel(seeds, positions, vocab_size: int, stream: int) -> jax.Array:
    """[..., V] Gumbel noise per (seed, position) entry, from its own stream."""
    seeds = jnp.broadcast_to(seeds, positions.shape)
    noise = jax.vmap(lambda s, p: jax.random.gumbel(_stream_key(s, p, stream), (vocab_size,), jnp.float32))
    return noise(seeds.ravel(), positions.ravel()).reshape(*positions.shape, vocab_size)


def accepted_prefix(accept: jax.Array, num_draft: jax.Array) -> jax.Array:
    """bool[R, k] per-draft verdicts -> i32[R]: how many leading drafts are kept."""
    k = accept.shape[1]
    valid = jnp.arange(k)[None, :] < num_draft[:, None]
    return jnp.sum(jnp.cumprod(accept & valid, axis=1), axis=1).astype(jnp.int32)


def _emit(drafts, last, num_accepted):
    """Output row: accepted drafts, then `last[r, a]` at index a (later entries: don't care)."""
    r, k = drafts.shape
    padded = jnp.concatenate([drafts, jnp.zeros((r, 1), drafts.dtype)], axis=1)
    j = jnp.arange(k + 1)[None, :]
    return jnp.where(j < num_accepted[:, None], padded, last)


def strict(target_tokens, drafts, num_draft):
    """-> (tokens i32[R, 1+k], num_accepted i32[R])."""
    num_accepted = accepted_prefix(target_tokens[:, :-1] == drafts, num_draft)
    return target_tokens, num_accepted


def synthetic(target_tokens, drafts, num_draft, seeds, positions, rate: float):
    """Each draft kept with probability `rate` (given the ones before it were)."""
    u = keyed_uniform(seeds[:, None], positions[:, 1:], _SYNTHETIC_STREAM)
    num_accepted = accepted_prefix(u < rate, num_draft)
    return _emit(drafts, target_tokens, num_accepted), num_accepted


def probabilistic(target_tokens, target_probs, drafts, draft_probs, num_draft, seeds, positions):
    """target_probs f32[R, 1+k, V] (the target's sampling distribution at each position);
    draft_probs f32[R, k, V] or None (one-hot drafts); positions i32[R, 1+k]: position of the
    token sampled at each index. -> (tokens, num_accepted)."""
    k = drafts.shape[1]
    v = target_probs.shape[-1]
    p = target_probs[:, :k]
    p_draft = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
        q = jax.nn.one_hot(drafts, v, dtype=p.dtype)
    else:
        q = draft_probs
        q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = keyed_uniform(seeds[:, None], positions[:, :k], _UNIFORM_STREAM)
    # u < p/q without dividing (q_draft > 0 for a sampled draft; 0/0 never accepts).
    num_accepted = accepted_prefix(u * q_draft < p_draft, num_draft)
    residual = jnp.maximum(p - q, 0.0)
    # Where p <= q everywhere the draft is always accepted; fall back to p to stay finite.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p)
    noise = keyed_gumbel(seeds[:, None], positions[:, :k], v, _RESIDUAL_STREAM)
    resampled = jnp.argmax(jnp.log(residual) + noise, axis=-1).astype(jnp.int32)
    # Index n (after the last draft) keeps the target's own pick: the bonus token.
    last = jnp.concatenate([resampled, target_tokens[:, k:]], axis=1)
    j = jnp.arange(k + 1)[None, :]
    last = jnp.where(j < num_draft[:, None], last, target_tokens)
    return _emit(drafts, last, num_accepted), num_accepted
