"""Attention backends the decoder layers call.

A backend is a callable `(q, k, v, layer, kv_cache, scale) -> (out, kv_cache)`. The model
code never knows whether it runs on the dense reference path or on the paged KV cache: the
backend object carries that step's metadata, and the decoder threads `kv_cache` through its
layer loop. Families whose q and k take a `QKNormRope` call `attend_qkv` with the fused
projection instead, so that a backend may do the norm, the rotation and the KV write in one kernel.
"""

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mrv2_jax.models.layer_weight import LayerWeight, weight_array
from mrv2_jax.models.layers import apply_rope_halves_partial, dense_causal_attention, rms_norm, split_qkv
from mrv2_jax.models.tensor_parallel import AXIS

_META_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "num_seqs")


@dataclass(frozen=True)
class QKNormRope:
    """What a family does to q and k between the fused projection and attention: RMSNorm of every
    head (Qwen3's q_norm / k_norm; None for families without) and "halves" RoPE over the first
    `2 * cos.shape[-1]` dims of a head."""

    q_norm: jax.Array | LayerWeight | None  # [head_dim], or its layer of a stack
    k_norm: jax.Array | LayerWeight | None
    eps: float
    cos: jax.Array  # float32[T, rotary_dim // 2]
    sin: jax.Array

    def __call__(self, q, k):
        if self.q_norm is not None:
            q, k = rms_norm(q, weight_array(self.q_norm), self.eps), rms_norm(k, weight_array(self.k_norm), self.eps)
        return apply_rope_halves_partial(q, self.cos, self.sin), apply_rope_halves_partial(k, self.cos, self.sin)


class AttentionBackend:
    """The entry from the fused projection; a backend that has a fused kernel for it overrides it."""

    def attend_qkv(self, qkv, heads, norm_rope: QKNormRope, layer, kv_cache, scale, shards=1):
        """`qkv [T, (H + 2 Hkv) * D]` (in the tensor-parallel layout of `shards` devices), `heads` =
        (H, Hkv, D): split, `norm_rope`, attend."""
        q, k, v = split_qkv(qkv, *heads, shards)
        q, k = norm_rope(q, k)
        return self(q, k, v, layer, kv_cache, scale)


@dataclass(frozen=True)
class DenseAttention(AttentionBackend):
    """Attention over the tokens of this call only (no KV cache): the reference path, also
    used for training. Tokens attend within their segment, causally by position."""

    segment_ids: jax.Array  # int32[T]
    positions: jax.Array  # int32[T]

    def __call__(self, q, k, v, layer, kv_cache, scale):
        del layer
        return dense_causal_attention(q, k, v, self.segment_ids, self.positions, scale), kv_cache


@dataclass(frozen=True)
class PagedAttention(AttentionBackend):
    """Attention over the paged KV cache: write this step's K/V into their slots, then run
    ragged paged attention for the whole mixed prefill/decode batch. Metadata layout:
    docs/architecture.md. `use_kernels=False` selects the pure-jnp references (fast on CPU,
    where Pallas only runs in its slow interpreter)."""

    slot_mapping: jax.Array  # int32[T]
    block_tables: jax.Array  # int32[R, max_blocks_per_seq]
    seq_lens: jax.Array  # int32[R]
    query_start_loc: jax.Array  # int32[R + 1]
    num_seqs: jax.Array  # int32[]
    use_kernels: bool = True
    interpret: bool = False
    # Fused decode: every row holds at most one query token, so with `decode_kernel` "mgpu" the
    # kernels' attention is the Mosaic GPU decode kernel, which takes row i's token at q[i].
    one_token_rows: bool = False
    decode_kernel: str = "pallas"
    # The kernel of every other step: "pallas" (Triton) or "mgpu" (Mosaic GPU). One-token rows never
    # take the Mosaic GPU one (a row's token would fill G of its 64 lanes): they take decode_kernel's,
    # in fused decode and in mixed steps alike (_mixed_rows_mgpu).
    ragged_kernel: str = "pallas"
    # Tensor parallelism: the jax.sharding.Mesh whose AXIS splits the heads of q, k, v and of the
    # KV cache; each device then writes and attends its own heads (shard_map), with the same
    # kernels. None: one device, no shard_map.
    mesh: object = None

    def __call__(self, q, k, v, layer, kv_cache, scale):
        if self.mesh is None:
            return self._attend(q, k, v, layer, kv_cache, scale)
        heads = P(None, AXIS, None)  # q, k, v, out: [T, heads, D]
        cache = P(None, None, AXIS, None, None)  # [layers, blocks, KV heads, block_size, D]
        meta = (self.slot_mapping, self.block_tables, self.seq_lens, self.query_start_loc, self.num_seqs)

        def local(q, k, v, layer, kv_cache, meta):
            # This device's heads, attended over its own slice of the cache: the metadata is the
            # whole batch's, replicated, so the arithmetic per head is that of one device.
            attention = dataclasses.replace(self, **dict(zip(_META_FIELDS, meta)), mesh=None)
            return attention._attend(q, k, v, layer, kv_cache, scale)

        # check_vma off: the Pallas kernels inside carry no varying-axes annotations.
        return jax.shard_map(local, mesh=self.mesh, in_specs=(heads, heads, heads, P(), (cache, cache), P()),
                             out_specs=(heads, (cache, cache)), check_vma=False)(q, k, v, layer, kv_cache, meta)

    def micro_batch(self, start, size: int) -> "PagedAttention":
        """The metadata of tokens [start, start + size) alone (a pipeline micro-batch,
        models/pipeline_parallel.py): each row keeps its query tokens in that range, and its context
        ends after the last of them (its later tokens are not in the cache yet). One-token-row
        kernels do not apply: rows no longer line up with tokens."""
        qsl = self.query_start_loc
        after = jnp.maximum(qsl[1:] - jnp.maximum(qsl[:-1], start + size), 0)
        return dataclasses.replace(self, slot_mapping=jax.lax.dynamic_slice_in_dim(self.slot_mapping, start, size),
                                   query_start_loc=jnp.clip(qsl - start, 0, size), seq_lens=self.seq_lens - after,
                                   one_token_rows=False)

    def attend_qkv(self, qkv, heads, norm_rope, layer, kv_cache, scale, shards=1):
        """With the kernels on one device: q/k norm, RoPE and the KV write in one kernel."""
        if not self.use_kernels or self.mesh is not None or shards > 1:
            return super().attend_qkv(qkv, heads, norm_rope, layer, kv_cache, scale, shards)
        from pallas_kernels.qk_norm_rope_kv_write import qk_norm_rope_kv_write

        q_norm, k_norm = norm_rope.q_norm, norm_rope.k_norm
        if isinstance(q_norm, LayerWeight) and isinstance(k_norm, LayerWeight):  # the stacks, read in place
            norms = dict(q_norm=q_norm.stack, k_norm=k_norm.stack, norm_layer=q_norm.layer)
        else:
            norms = dict(q_norm=weight_array(q_norm), k_norm=weight_array(k_norm))
        q, k_cache, v_cache = qk_norm_rope_kv_write(qkv, cos=norm_rope.cos, sin=norm_rope.sin, k_cache=kv_cache[0],
                                                    v_cache=kv_cache[1], slot_mapping=self.slot_mapping, layer=layer,
                                                    num_heads=heads[0], eps=norm_rope.eps, interpret=self.interpret,
                                                    **norms)
        return self._attend_cached(q, layer, (k_cache, v_cache), scale)

    def _attend(self, q, k, v, layer, kv_cache, scale):
        from pallas_kernels import kv_write

        write = kv_write.write_kv if self.use_kernels else kv_write.write_kv_reference
        kv_cache = write(*kv_cache, k, v, self.slot_mapping, layer, interpret=self.interpret)
        return self._attend_cached(q, layer, kv_cache, scale)

    def _attend_cached(self, q, layer, kv_cache, scale):
        """Attention of q over the cache, this step's K/V already in it."""
        from pallas_kernels import ragged_paged_attention as rpa

        attend = rpa.ragged_paged_attention_reference
        if self.use_kernels:
            attend = functools.partial(rpa.ragged_paged_attention, interpret=self.interpret)
            if self.ragged_kernel == "mgpu" and not self.one_token_rows:
                attend = functools.partial(_mixed_rows_mgpu, decode_kernel=self.decode_kernel, interpret=self.interpret)
            if self.one_token_rows and self.decode_kernel == "mgpu":
                attend = functools.partial(_one_token_rows_mgpu, interpret=self.interpret)
        out = attend(q, *kv_cache, layer, self.block_tables, self.seq_lens,
                     self.query_start_loc, self.num_seqs, sm_scale=scale)
        return out, kv_cache


def _one_token_rows_mgpu(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs, *,
                         sm_scale, interpret=False):
    """ragged_paged_attention for a step whose rows hold at most one query token each, through the
    Mosaic GPU decode kernel (row i's token at q[i]): tokens go to their rows, a row without one
    gets no keys, and the rows' outputs come back in token order (padding tokens 0)."""
    from pallas_kernels.paged_decode_attention_mgpu import paged_decode_attention_mgpu

    num_rows, num_tokens = block_tables.shape[0], q.shape[0]
    if num_rows < num_tokens:
        raise ValueError(f"one token per row: {num_tokens} tokens for {num_rows} rows")
    starts = query_start_loc[:num_rows]
    has_token = (query_start_loc[1:] > starts) & (jnp.arange(num_rows) < num_seqs)
    q_rows = jnp.where(has_token[:, None, None], q[jnp.minimum(starts, num_tokens - 1)], 0)
    out_rows = paged_decode_attention_mgpu(q_rows, k_cache, v_cache, block_tables, jnp.where(has_token, seq_lens, 0),
                                           num_seqs, layer=layer, sm_scale=sm_scale, interpret=interpret)
    tokens = jnp.arange(num_tokens)
    row_of_token = jnp.searchsorted(query_start_loc[1:], tokens, side="right", method="compare_all")
    real = tokens < query_start_loc[num_seqs]
    return jnp.where(real[:, None, None], out_rows[jnp.minimum(row_of_token, num_rows - 1)], 0)


def _mixed_rows_mgpu(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs, *,
                     sm_scale, decode_kernel="pallas", interpret=False):
    """ragged_paged_attention for a mixed step through the Mosaic GPU ragged kernel, its one-token rows
    (decode rows) through `decode_kernel`'s: the ragged kernel sees those rows without context (a tile
    that reads no keys and stores zeros), then one call of the decode kernel attends every row's first
    token at q[row] (rows with more tokens attend one token more, whose output is dropped) and the
    decode rows' outputs replace those zeros."""
    from pallas_kernels import ragged_paged_attention as rpa
    from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu

    num_rows, num_tokens = block_tables.shape[0], q.shape[0]
    starts = query_start_loc[:num_rows]
    decode = (query_start_loc[1:] - starts == 1) & (jnp.arange(num_rows) < num_seqs)
    out = ragged_paged_attention_mgpu(q, k_cache, v_cache, layer, block_tables, jnp.where(decode, 0, seq_lens),
                                      query_start_loc, num_seqs, sm_scale=sm_scale, interpret=interpret)
    q_rows = q[jnp.minimum(starts, num_tokens - 1)]
    if decode_kernel == "mgpu":
        from pallas_kernels.paged_decode_attention_mgpu import paged_decode_attention_mgpu

        out_rows = paged_decode_attention_mgpu(q_rows, k_cache, v_cache, block_tables, seq_lens, num_seqs, layer=layer,
                                               sm_scale=sm_scale, interpret=interpret)
    else:
        out_rows = rpa.ragged_paged_attention(q_rows, k_cache, v_cache, layer, block_tables, seq_lens,
                                              jnp.arange(num_rows + 1, dtype=jnp.int32), num_seqs, sm_scale=sm_scale,
                                              interpret=interpret)
    return out.at[jnp.where(decode, starts, num_tokens)].set(out_rows.astype(out.dtype), mode="drop")
