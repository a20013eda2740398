"""Pipeline parallelism, the model's side: the decoder layers run as stages over the devices of a
mesh axis, each stage holding a contiguous slice of the layers and of the KV cache's layer axis.

Under `jax.shard_map` over PP_AXIS, stage s runs its layers on the hidden states at iteration s
(a `lax.cond` on the stage index, so the others idle), then `lax.ppermute` hands them to stage
s + 1; the last stage's output is summed with the others' zeros, so every device ends with it.
The attention's `layer` is the stage's local layer index: its KV cache holds only its own layers.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

PP_AXIS = "pp"  # the mesh axis the decoder layers and the KV cache's layer axis are split over


def check_pipeline(flag: str, n: int, num_layers: int, runs: list) -> None:
    """ValueError naming `flag` unless the layers can be split into n equal contiguous stages of
    one layer group (`runs`: decoder.layer_runs of the model's groups)."""
    if len(runs) != 1:
        raise ValueError(f"{flag}={n}: models with several layer groups (e.g. MoE with dense layers between) "
                         "are not supported with pipeline parallelism yet")
    if num_layers % n:
        raise ValueError(f"{flag}={n} must divide the model's num_hidden_layers ({num_layers})")


def pipeline_layers(mesh, run_layers, x, stack, kv_cache, rope, attention):
    """`run_layers(stack, layer_ids, x, rope, attention, kv_cache) -> (x, kv_cache)` over the
    stages of `mesh`'s PP_AXIS: `stack` and `kv_cache` are split on their leading (layer) axis,
    everything else replicated. -> (x after every layer, on every device; kv_cache)."""
    n = mesh.shape[PP_AXIS]
    arrays = _array_fields(attention)
    layers = P(PP_AXIS)

    attention_static = attention

    def stages(x, stack, kv_cache, rope, arrays):
        attention = dataclasses.replace(attention_static, **arrays)
        stage = jax.lax.axis_index(PP_AXIS)
        local_ids = jnp.arange(jax.tree.leaves(stack)[0].shape[0], dtype=jnp.int32)

        def run(x, kv):
            return run_layers(stack, local_ids, x, rope, attention, kv)

        for i in range(n):
            # Only stage i runs at iteration i: the others carry their values through unchanged.
            x, kv_cache = jax.lax.cond(stage == i, run, lambda x, kv: (x, kv), x, kv_cache)
            if i < n - 1:
                x = jax.lax.ppermute(x, PP_AXIS, [(i, i + 1)])
        # Every device gets the last stage's output: the others add zeros, which is exact.
        x = jax.lax.psum(jnp.where(stage == n - 1, x, jnp.zeros_like(x)), PP_AXIS)
        return x, kv_cache

    # check_vma off: the stages' values differ per device by design (cond on the stage index).
    return jax.shard_map(stages, mesh=mesh, in_specs=(P(), layers, layers, P(), P()),
                         out_specs=(P(), layers), check_vma=False)(x, stack, kv_cache, rope, arrays)


def _array_fields(obj) -> dict:
    """A dataclass's array fields (the step's attention metadata): they enter shard_map replicated,
    and replace the outer ones in the copy each stage builds."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), jax.Array)}
