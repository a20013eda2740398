"""The device half of one step, shared by every runner: forward pass, logits of the rows that
sample, and sampling. Pure: (params, kv_cache, inputs) -> (kv_cache, tokens)."""

import jax
from flax import nnx

from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.sample.sampler import sample_tokens


class FlatParams:
    """The model split once into a static graph and a flat tuple of parameter leaves.

    Passing ~15 flat leaves to the jitted step (instead of the nnx Module) keeps the per-step
    host cost of argument handling near its floor; the module is rebuilt at trace time."""

    def __init__(self, lm):
        self.graphdef, state = nnx.split(lm)
        self.leaves, self.treedef = jax.tree.flatten(state)

    def merge(self, leaves):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


def forward_and_sample(lm, kv_cache, *, input_ids, positions, attention: PagedAttention,
                       logits_indices, temperature, seeds):
    hidden, kv_cache = lm(input_ids, positions, attention, kv_cache)
    logits = lm.compute_logits(hidden[logits_indices])
    # The sampled token sits one position after the last scheduled token of its row.
    tokens = sample_tokens(logits, temperature, seeds, positions[logits_indices] + 1)
    return kv_cache, tokens
