"""The device half of one step, shared by every runner: forward pass, logits of the rows that
sample, and sampling. Pure: (params, kv_cache, inputs) -> (kv_cache, sampled tokens)."""

import jax
from flax import nnx

from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.sample.features import SamplerFeatures
from mrv2_jax.sample.penalties import PenaltyData
from mrv2_jax.sample.sampler import SamplerOutput, sample, sample_tokens
from mrv2_jax.sample.tensors import SamplingTensors


class FlatParams:
    """The model split once into a static graph and a flat tuple of parameter leaves.

    Passing ~15 flat leaves to the jitted step (instead of the nnx Module) keeps the per-step
    host cost of argument handling near its floor; the module is rebuilt at trace time."""

    def __init__(self, lm):
        self.graphdef, state = nnx.split(lm)
        self.leaves, self.treedef = jax.tree.flatten(state)

    def merge(self, leaves):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


def forward_logits(lm, kv_cache, *, input_ids, positions, attention: PagedAttention, logits_indices):
    """-> (kv_cache, f32[R, V] logits of the last scheduled token of each row)."""
    hidden, kv_cache = lm(input_ids, positions, attention, kv_cache)
    return kv_cache, lm.compute_logits(hidden[logits_indices])


def forward_and_sample(lm, kv_cache, *, input_ids, positions, attention: PagedAttention,
                       logits_indices, temperature, seeds):
    """Temperature-only sampling -> (kv_cache, tokens i32[R])."""
    kv_cache, logits = forward_logits(lm, kv_cache, input_ids=input_ids, positions=positions,
                                      attention=attention, logits_indices=logits_indices)
    # The sampled token sits one position after the last scheduled token of its row.
    tokens = sample_tokens(logits, temperature, seeds, positions[logits_indices] + 1)
    return kv_cache, tokens


def forward_and_sample_full(lm, kv_cache, *, input_ids, positions, attention: PagedAttention,
                            logits_indices, sampling: SamplingTensors, features: SamplerFeatures,
                            penalties: PenaltyData | None = None) -> tuple[object, SamplerOutput]:
    """Every sampling parameter -> (kv_cache, SamplerOutput)."""
    kv_cache, logits = forward_logits(lm, kv_cache, input_ids=input_ids, positions=positions,
                                      attention=attention, logits_indices=logits_indices)
    return kv_cache, sample(logits, sampling, positions[logits_indices] + 1, features, penalties)
