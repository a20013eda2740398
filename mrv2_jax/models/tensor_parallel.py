"""Tensor parallelism, the model's side: which layer weights are split across devices, and the
per-shard layout of fused weights.

A decoder layer is split Megatron-style over N devices (linear weights are stored [out, in]): the
q/k/v and gate/up projections by their output features (column-parallel, axis 0: each device
computes whole heads / whole MLP units), the o and down projections by their input features
(row-parallel, axis 1: each device's partial products are summed by one all-reduce). Everything
else (norms, embeddings, lm_head) is replicated.

Fused weights need care: `qkv_proj`'s rows are [q | k | v], so cutting them into N equal
pieces would give device 0 all of q and device N-1 all of v. `interleave_shards` re-orders the
rows ONCE, when the weights are placed, into [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (piece d holds
device d's whole heads of each part); `split_sharded` undoes it at run time as a view, so that
device d finds its own q, k and v inside its own outputs and no data moves.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

AXIS = "tp"  # the mesh axis the layer weights and the KV heads are split over


@dataclass(frozen=True)
class ShardRule:
    """How one layer parameter (shape without the layer axis) is split over the devices.

    `axis`: the axis cut into N equal contiguous pieces. `widths`: for a fused parameter, the
    widths of its parts along that axis (each part is cut into N pieces, interleaved by
    `interleave_shards`); () for a plain one."""

    axis: int
    widths: tuple[int, ...] = ()


def check_divides(flag: str, n: int, counts: dict[str, int]) -> None:
    """ValueError naming `flag` unless `n` divides every count (heads, KV heads, MLP units).
    Fewer KV heads than devices gets its own message: each device would need a copy of some."""
    kv = counts.get("KV heads")
    if kv is not None and n > kv:
        raise ValueError(f"{flag}={n} exceeds the model's {kv} KV heads: replicating KV heads over devices "
                         "is not supported yet")
    for what, count in counts.items():
        if count % n:
            raise ValueError(f"{flag}={n} must divide the model's {what} ({count})")


def interleave_shards(w: jax.Array, widths: tuple[int, ...], n: int, axis: int) -> jax.Array:
    """Re-order a fused parameter along `axis` from [part_0 | part_1 | ...] to
    [part_0[piece 0] part_1[piece 0] ... | part_0[piece 1] ...], each part cut into n pieces."""
    parts = jnp.split(w, [sum(widths[:i]) for i in range(1, len(widths))], axis=axis)
    pieces = [jnp.split(p, n, axis=axis) for p in parts]
    return jnp.concatenate([pieces[j][d] for d in range(n) for j in range(len(parts))], axis=axis)


def split_sharded(x: jax.Array, widths: tuple[int, ...], n: int) -> list[jax.Array]:
    """The parts of a fused output [..., sum(widths)] computed with an `interleave_shards`
    weight: -> [..., width] each, in the original order. A view of whole shards: under a
    sharding on the last axis, each device only reads its own columns."""
    lead = x.shape[:-1]
    x = x.reshape(*lead, n, sum(widths) // n)
    bounds = [sum(widths[:i]) // n for i in range(len(widths) + 1)]
    return [x[..., lo:hi].reshape(*lead, w) for lo, hi, w in zip(bounds, bounds[1:], widths)]


def row_parallel(x: jax.Array, w: jax.Array, shards: int) -> jax.Array:
    """`x @ w.T` for a row-parallel linear weight `w [out, in]` (split by its input features): each device's partial
    product stays float32 through the all-reduce and is rounded to x's dtype once, after the sum, as
    one device's GEMM rounds once after accumulating in f32 (a bf16 sum of bf16 partials would round
    N + 1 times and flip near-tied greedy tokens). One device: a plain product."""
    if shards == 1:
        return jnp.einsum("...i,oi->...o", x, w)
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
