"""Pipeline parallelism, the model's side: the decoder layers run as stages over the devices of a
mesh axis, each stage holding a contiguous slice of the layers and of the KV cache's layer axis.

Under `jax.shard_map` over PP_AXIS the step's tokens are cut into micro-batches (as many as there
are stages, when they divide the token count; else one). At iteration i stage s runs its layers on
micro-batch i - s (a `lax.cond` on the stage index: a stage with none idles), then `lax.ppermute`
hands the result to stage s + 1; so from the second iteration on, the stages work at once. Each
micro-batch attends with its own metadata (PagedAttention.micro_batch): a row cut by the boundary
finds its earlier tokens' K/V already in the stage's cache. The last stage's outputs are summed
with the others' zeros, so every device ends with them. The attention's `layer` is the stage's
local layer index: its KV cache holds only its own layers.
"""

import dataclasses
import functools

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


def num_micro_batches(n: int, num_tokens: int, attention) -> int:
    """n micro-batches when n divides the step's tokens and the attention can be cut; else one."""
    return n if num_tokens % n == 0 and hasattr(attention, "micro_batch") else 1


def pipeline_layers(mesh, run_layers, x, stack, kv_cache, rope, attention):
    """`run_layers(stack, layer_ids, x, rope, attention, kv_cache) -> (x, kv_cache)` over the
    stages of `mesh`'s PP_AXIS: `stack` and `kv_cache` are split on their leading (layer) axis,
    everything else replicated; `rope`'s leaves are per token. -> (x after every layer, on every
    device; kv_cache)."""
    n = mesh.shape[PP_AXIS]
    micro = num_micro_batches(n, x.shape[0], attention)
    size = x.shape[0] // micro
    arrays = _array_fields(attention)
    layers = P(PP_AXIS)

    def stages(x, stack, kv_cache, rope, arrays):
        whole = dataclasses.replace(attention, **arrays)
        stage = jax.lax.axis_index(PP_AXIS)
        local_ids = jnp.arange(jax.tree.leaves(stack)[0].shape[0], dtype=jnp.int32)

        def run(m, inp, kv):
            piece = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=m * size, slice_size=size)
            part = whole if micro == 1 else whole.micro_batch(m * size, size)
            return run_layers(stack, local_ids, inp, jax.tree.map(piece, rope), part, kv)

        received = jnp.zeros((size, *x.shape[1:]), x.dtype)
        outs = jnp.zeros((micro, size, *x.shape[1:]), x.dtype)
        for i in range(n + micro - 1):
            m = jnp.clip(i - stage, 0, micro - 1)
            active = (i - stage >= 0) & (i - stage < micro)
            inp = jnp.where(stage == 0, jax.lax.dynamic_slice_in_dim(x, m * size, size), received)
            y, kv_cache = jax.lax.cond(active, functools.partial(run, m), lambda inp, kv: (inp, kv), inp, kv_cache)
            keep = active & (stage == n - 1)
            outs = jax.lax.dynamic_update_index_in_dim(outs, jnp.where(keep, y, outs[m]), m, 0)
            # The stages that ran this iteration hand their micro-batch on (static: i and micro are).
            senders = range(max(0, i - micro + 1), min(i, n - 2) + 1)
            if i < n + micro - 2 and senders:
                received = jax.lax.ppermute(y, PP_AXIS, [(s, s + 1) for s in senders])
        # Every device gets the last stage's outputs: the others add zeros, which is exact.
        out = outs.reshape(x.shape)
        return jax.lax.psum(jnp.where(stage == n - 1, out, jnp.zeros_like(out)), PP_AXIS), kv_cache

    # check_vma off: the stages' values differ per device by design (cond on the stage index).
    return jax.shard_map(stages, mesh=mesh, in_specs=(P(), layers, layers, P(), P()),
                         out_specs=(P(), layers), check_vma=False)(x, stack, kv_cache, rope, arrays)


def _array_fields(obj) -> dict:
    """A dataclass's array fields (the step's attention metadata): they enter shard_map replicated,
    and replace the outer ones in the copy each stage builds."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), jax.Array)}
