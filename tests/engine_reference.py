"""An independent reference for engine outputs: a plain one-request-at-a-time greedy loop over
the dense (no KV cache) forward pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mrv2_jax.models.loader import load_model

PAD_TO = 160


@functools.cache
def _dense_forward(model_dir: str):
    _, lm, _ = load_model(model_dir, dtype="float32")
    graphdef, weights = nnx.split(lm)

    # The weights are an argument, not constants folded into the program: a 0.6B model's program
    # would otherwise hold all of them (slow to compile, too large for the compilation cache).
    @jax.jit
    def last_logits(weights, ids, length):
        # Padding tokens get their own segment so they never influence the real ones.
        segment = (jnp.arange(PAD_TO) >= length).astype(jnp.int32)
        logits = nnx.merge(graphdef, weights).forward_dense(ids, jnp.arange(PAD_TO, dtype=jnp.int32), segment)
        return logits[length - 1]

    return functools.partial(last_logits, weights)


def greedy_reference(model_dir, prompt: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    forward = _dense_forward(str(model_dir))
    seq = list(prompt)
    for _ in range(max_tokens):
        ids = np.zeros(PAD_TO, np.int32)
        ids[: len(seq)] = seq
        token = int(jnp.argmax(forward(jnp.asarray(ids), len(seq))))
        seq.append(token)
        if token == eos:
            break
    return seq[len(prompt):]
