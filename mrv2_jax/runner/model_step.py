"""The device half of one step, shared by every runner: forward pass, logits of the rows that
sample, and sampling. Pure: (params, kv_cache, inputs) -> (kv_cache, sampled tokens)."""

import jax
import jax.numpy as jnp
from flax import nnx

from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.sample import automata as automata_lib
from mrv2_jax.sample.features import SamplerFeatures
from mrv2_jax.sample.logprobs import compute_logprobs, empty_logprobs
from mrv2_jax.sample.penalties import PenaltyData
from mrv2_jax.sample.sampler import SamplerOutput, sample
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
    """-> (kv_cache, [R, V] logits of the last scheduled token of each row in the model's dtype,
    hidden [T, H] of every token)."""
    hidden, kv_cache = lm(input_ids, positions, attention, kv_cache)
    return kv_cache, lm.compute_logits(hidden[logits_indices], None), hidden


# Prompt logprobs are computed over the token axis in pieces of this many tokens, so a long
# prefill step never holds a [T, V] f32 array, only [PROMPT_LOGPROBS_CHUNK, V].
PROMPT_LOGPROBS_CHUNK = 256
PROMPT_LOGPROBS_TOP = 20  # sampling_params.MAX_LOGPROBS: the host keeps each request's first n


def prompt_logprobs(lm, hidden, targets, *, runtime_skip: bool = True, kernel_mode: str = "reference"):
    """Logprobs of the prompt tokens: `targets` i32[T] holds, for each scheduled token whose
    row asked for prompt logprobs, 1 + the id of the prompt token that follows it (0 = none).
    -> Logprobs over [T] (the target, then the top PROMPT_LOGPROBS_TOP), from the raw logits
    of every token; only computed when some token has a target. kernel_mode:
    SamplerKernels.logit_stats."""
    t = hidden.shape[0]
    ids = jnp.maximum(targets - 1, 0)
    n = PROMPT_LOGPROBS_TOP

    def compute():
        chunk = PROMPT_LOGPROBS_CHUNK
        # Logits in the model's dtype: compute_logprobs reads them as f32 where it reads them.
        def logprobs_of(h, target_ids):
            return compute_logprobs(lm.compute_logits(h, None), target_ids, n, kernel_mode=kernel_mode)

        if t <= chunk or t % chunk:
            return logprobs_of(hidden, ids)
        parts = jax.lax.map(lambda a: logprobs_of(*a),
                            (hidden.reshape(t // chunk, chunk, -1), ids.reshape(t // chunk, chunk)))
        return jax.tree.map(lambda x: x.reshape(t, *x.shape[2:]), parts)

    if not runtime_skip:
        return compute()
    return jax.lax.cond(jnp.any(targets > 0), compute, lambda: empty_logprobs(t, n))


def forward_and_sample(lm, kv_cache, *, input_ids, positions, attention: PagedAttention,
                       logits_indices, sampling: SamplingTensors, features: SamplerFeatures,
                       penalties: PenaltyData | None = None, prompt_targets=None,
                       automata: tuple | None = None) -> tuple[object, SamplerOutput]:
    """The forward pass, then the sampler with every sampling parameter -> (kv_cache, SamplerOutput).
    With `features.prompt_logprobs`, `prompt_targets` (see `prompt_logprobs`) gives the output's
    prompt logprob fields. `automata`: (AutomatonTables, EOS id) with `features.structured`: the
    constrained rows' logits are masked by their automaton state (sample/automata.py); None from
    a runner that runs no constraints (V1)."""
    # The sampler gets the logits in the model's dtype and converts where it reads them (exact):
    # an f32 copy ahead of its Pallas pass would be written out and then read at twice the bytes
    # (docs/benchmarks.md, "Sampler: bf16 logits").
    kv_cache, logits, hidden = forward_logits(lm, kv_cache, input_ids=input_ids, positions=positions,
                                              attention=attention, logits_indices=logits_indices)
    if features.structured and automata is not None:
        tables, eos_token_id = automata
        logits = automata_lib.mask_logits(logits, tables, sampling.automaton_state, eos_token_id)
    out = sample(logits, sampling, positions[logits_indices] + 1, features, penalties)
    if features.prompt_logprobs and prompt_targets is not None:
        lp = prompt_logprobs(lm, hidden, prompt_targets, runtime_skip=features.runtime_skip,
                             kernel_mode=features.kernels.logit_stats)
        out = out._replace(prompt_logprobs=lp.logprobs, prompt_token_ids=lp.token_ids, prompt_rank=lp.sampled_rank)
    return kv_cache, out
