"""An independent reference for engine outputs: a plain one-request-at-a-time greedy loop over
the dense (no KV cache) forward pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.models.loader import load_model

PAD_TO = 160


@functools.cache
def _dense_forward(model_dir: str, load_format: str):
    _, lm, _ = load_model(model_dir, dtype="float32", load_format=load_format)

    @jax.jit
    def last_logits(ids, length):
        # Padding tokens get their own segment so they never influence the real ones.
        segment = (jnp.arange(PAD_TO) >= length).astype(jnp.int32)
        logits = lm.forward_dense(ids, jnp.arange(PAD_TO, dtype=jnp.int32), segment)
        return logits[length - 1]

    return last_logits


def greedy_reference(model_dir, prompt: list[int], max_tokens: int, eos: int | None = None,
                     load_format: str = "auto") -> list[int]:
    """`load_format="dummy"`: the same seeded random weights as an engine built with it."""
    forward = _dense_forward(str(model_dir), load_format)
    seq = list(prompt)
    for _ in range(max_tokens):
        ids = np.zeros(PAD_TO, np.int32)
        ids[: len(seq)] = seq
        token = int(jnp.argmax(forward(jnp.asarray(ids), len(seq))))
        seq.append(token)
        if token == eos:
            break
    return seq[len(prompt):]
