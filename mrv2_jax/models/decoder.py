"""`CausalLM`: a decoder-only language model whose per-layer weights are stacked.

Every per-layer weight of the same kind lives in ONE array with a leading layer axis, and the
layers run as a `lax.scan` over that axis. Two reasons: a jitted call costs ~0.6 us of host
time per argument leaf, so ~15 stacked leaves instead of ~300 per-layer ones keeps dispatch
cheap; and the scan carries the stacked KV cache, which XLA then updates in place.
The family-specific math (norm placement, rotary variant, ...) comes from the `ModelState`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mrv2_jax.models.attention import DenseAttention
from mrv2_jax.models.layer_weight import LayerWeight
from mrv2_jax.models.layers import rms_norm
from mrv2_jax.models.pipeline_parallel import pipeline_layers


class StackedLayers(nnx.Module):
    """Holds one `nnx.Param` per layer-weight kind, each shaped [num_layers, ...]."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], num_layers: int, dtype, rngs: nnx.Rngs,
                 dtypes: dict | None = None):
        self.names = tuple(sorted(shapes))
        for name in self.names:
            param_dtype = (dtypes or {}).get(name, dtype)
            setattr(self, name, nnx.Param(init_weight(name, (num_layers, *shapes[name]), param_dtype,
                                                     rngs.params())))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in self.names}


def init_weight(name: str, shape, dtype, key) -> jax.Array:
    """Norm scales start at one, everything else small and random (std 0.02). FP8 weights are
    unit-scale random values and their block scales 0.02, so that dequantised they look alike;
    biases of the router start at zero."""
    return init_of_kind(init_kind(name), shape, dtype, key)


def init_kind(name: str) -> str:
    """How a parameter named `name` starts: "ones", "scales" (0.02), "zeros" or "random"."""
    if "norm" in name:
        return "ones"
    if name.endswith("_scale"):
        return "scales"
    if name.endswith("_bias") and "router" in name:
        return "zeros"
    return "random"


# The value each constant kind of init_kind starts at.
CONSTANT_INITS = {"ones": 1.0, "scales": 0.02, "zeros": 0.0}


def random_init_scale(dtype) -> float:
    """The standard deviation of a "random" parameter: 1 in 8-bit dtypes (fp8), else 0.02."""
    return 1.0 if jnp.dtype(dtype).itemsize == 1 else 0.02


def init_of_kind(kind: str, shape, dtype, key) -> jax.Array:
    if kind in CONSTANT_INITS:
        return jnp.full(shape, CONSTANT_INITS[kind], dtype)
    return _random_normal(key, tuple(shape), dtype, random_init_scale(dtype))


def _random_normal(key, shape, dtype, scale):
    """scale * N(0, 1) in `dtype`. Huge stacked tensors (MoE experts: 20-66 G elements) are
    made one slice of the leading axis at a time, so that no float32 temporary of the whole
    tensor can exist next to the weights."""
    if len(shape) >= 3 and math.prod(shape) > 2**28:
        keys = jax.random.split(key, shape[0])
        return jax.lax.map(lambda k: _random_normal(k, shape[1:], dtype, scale), keys)
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def layer_runs(groups) -> list[tuple[str, int, int]]:
    """Maximal runs of consecutive layers of one group, in layer order:
    [(group name, index of the run's first layer within the group, run length)]."""
    owner = {layer: (name, j) for name, g in groups.items() for j, layer in enumerate(g.layers)}
    if sorted(owner) != list(range(len(owner))):
        raise ValueError(f"layer groups must cover layers 0..N-1 exactly once, got {sorted(owner)}")
    runs = []
    for layer in range(len(owner)):
        name, j = owner[layer]
        if runs and runs[-1][0] == name and runs[-1][1] + runs[-1][2] == j:
            runs[-1] = (name, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((name, j, 1))
    return runs


class CausalLM(nnx.Module):
    def __init__(self, spec, dtype, rngs: nnx.Rngs, layer_unroll: int | bool = 1):
        self.spec = spec  # the ModelState; static, not a parameter
        self.layer_unroll = layer_unroll
        # A one-token program (fused decode's one-row bucket, the one-token step bucket) sets this on
        # the module it traces: the family's `gemv_weights` reach its layer as LayerWeights, for the
        # GEMV kernel (models/gemv_projections.py).
        self.gemv_projections = False
        # Pipeline parallelism (models/pipeline_parallel.py): the mesh whose PP_AXIS the layers are
        # split over, set when the weights are placed there; None: all layers on every device.
        self.pipeline_mesh = None
        h, v = spec.hidden_size, spec.vocab_size
        self.embed_tokens = nnx.Param(init_weight("embed_tokens", (v, h), dtype, rngs.params()))
        for name, group in spec.layer_groups().items():
            setattr(self, name, StackedLayers(group.shapes, len(group.layers), dtype, rngs, group.dtypes))
        mtp = spec.mtp_group()
        if mtp is not None:
            self.mtp = StackedLayers(mtp.shapes, len(mtp.layers), dtype, rngs, mtp.dtypes)
        self.final_norm = nnx.Param(init_weight("final_norm", (h,), dtype, rngs.params()))
        if not spec.tie_word_embeddings:
            self.lm_head = nnx.Param(init_weight("lm_head", (v, h), dtype, rngs.params()))

    def __call__(self, input_ids, positions, attention, kv_cache=()):
        """Flattened tokens -> (final hidden states [T, H], updated kv_cache)."""
        x = self.embed_tokens[...][input_ids]
        rope = self.spec.rope(positions)
        groups = self.spec.layer_groups()
        if self.pipeline_mesh is not None:  # one group, its layers split into stages over the mesh
            (name, _, _), = layer_runs(groups)
            x, kv_cache = pipeline_layers(self.pipeline_mesh, functools.partial(self._run, groups[name].forward, None),
                                          x, getattr(self, name).arrays(), kv_cache, rope, attention)
            return rms_norm(x, self.final_norm[...], self.spec.rms_norm_eps), kv_cache
        for name, start, count in layer_runs(groups):
            group = groups[name]
            stack = getattr(self, name).arrays()
            layer_ids = np.asarray(group.layers[start:start + count], dtype=np.int32)
            if count == len(group.layers):  # the usual case: the scan walks the whole stack
                x, kv_cache = self._run(group.forward, None, stack, layer_ids, x, rope, attention, kv_cache)
            else:
                # Part of a stack: index it inside the loop (a dynamic slice of one layer)
                # rather than slicing the run out first, which XLA would copy.
                x, kv_cache = self._run(group.forward, np.arange(start, start + count, dtype=np.int32), stack,
                                        layer_ids, x, rope, attention, kv_cache)
        return rms_norm(x, self.final_norm[...], self.spec.rms_norm_eps), kv_cache

    def _run(self, forward, indices, stack, layer_ids, x, rope, attention, kv_cache):
        """A `lax.scan` of `forward` over layers: the whole `stack` with `indices` None, else the
        layers of `stack` at `indices` (taken inside the loop); `layer_ids` the KV cache's layers.

        Layer indices are numpy constants, not `jnp.arange` (an iota): where XLA unrolls the scan,
        each layer's index then folds to a literal instead of a one-thread slice kernel a layer."""
        # Weights handed on with their stack and layer (LayerWeight); the others sliced per layer,
        # by the scan itself where it walks the whole stack (the weights' GEMMs read those slices in
        # place through XLA's dynamic-slice fusion).
        in_place = set(self.spec.in_place_weights) | (set(self.spec.gemv_weights) if self.gemv_projections else set())
        wrapped = in_place & set(stack) if self.pipeline_mesh is None else set()

        def wrap(j):
            return {k: LayerWeight(stack[k], j) for k in wrapped}

        if indices is None and not wrapped:
            xs, take = (stack, layer_ids), lambda params: params
        elif indices is None:
            sliced = {k: v for k, v in stack.items() if k not in wrapped}
            xs = ((sliced, np.arange(layer_ids.shape[0], dtype=np.int32)), layer_ids)

            def take(params):
                return params[0] | wrap(params[1])
        else:
            xs = (indices, layer_ids)

            def take(j):
                return {k: v[j] for k, v in stack.items() if k not in wrapped} | wrap(j)

        def one_layer(carry, xs):
            x, kv = carry
            params, layer = xs
            x, kv = forward(take(params), x, rope, attention, layer, kv)
            return (x, kv), None

        (x, kv_cache), _ = jax.lax.scan(one_layer, (x, kv_cache), xs, unroll=self.layer_unroll)
        return x, kv_cache

    def compute_logits(self, hidden: jax.Array, dtype=jnp.float32) -> jax.Array:
        """[N, H] -> [N, vocab] in `dtype` (None: the model dtype, for readers that convert
        where they read, such as the sampler).

        The GEMM accumulates in f32 but returns the model dtype (as vLLM's lm_head does), cast
        after: asking the GEMM for f32 output made XLA convert the whole bf16 [vocab, H] matrix
        to f32 every step before a cuBLAS f32 GEMV (a large share of a batch-1 step)."""
        head = self.embed_tokens if self.spec.tie_word_embeddings else self.lm_head  # [vocab, H] either way
        logits = jnp.einsum("nh,vh->nv", hidden, head[...])
        return logits if dtype is None else logits.astype(dtype)

    def forward_mtp(self, depth, input_ids, prev_hidden, positions, attention, kv_cache=(),
                    return_pre_norm: bool = False):
        """Multi-token-prediction layer `depth` (families with `spec.has_mtp`): the next tokens'
        ids and the previous model's hidden states [T, H] -> (hidden [T, H] for
        `compute_logits`, kv_cache). Its attention uses layer index `num_layers + depth`.
        `return_pre_norm`: -> (hidden, the layer's output before its final norm, kv_cache); the
        latter is what a chained MTP step takes as `prev_hidden` (spec_decode/mtp_proposer.py)."""
        group = self.spec.mtp_group()
        params = {k: v[depth] for k, v in self.mtp.arrays().items()}
        hidden, pre_norm, kv_cache = group.forward(params, self.embed_tokens[...][input_ids], prev_hidden,
                                                   self.spec.rope(positions), attention, group.layers[depth],
                                                   kv_cache)
        return (hidden, pre_norm, kv_cache) if return_pre_norm else (hidden, kv_cache)

    def forward_dense(self, input_ids, positions, segment_ids):
        """Logits for every token, attending within segments (tests and training)."""
        hidden, _ = self(input_ids, positions, DenseAttention(segment_ids, positions))
        return self.compute_logits(hidden)
