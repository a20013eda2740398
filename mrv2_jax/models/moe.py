"""Mixture-of-experts building blocks: routers and the routed expert MLPs.

Expert computation, for T tokens each routed to k experts:
  1. sort the T*k (token, expert) pairs by expert on the device (a stable argsort);
  2. gather the tokens' hidden states in that order and run the experts' SwiGLU MLP as two
     grouped GEMMs (rows of expert e against expert e's weights only);
  3. un-permute and sum each token's k outputs weighted by its routing weights.
The grouped GEMM is chosen by `backend`:
  - "pallas": the Pallas/Triton kernel (pallas_kernels/grouped_gemm.py), for GPUs;
  - "mgpu": the Pallas Mosaic GPU kernel (pallas_kernels/grouped_gemm_mgpu.py: TMA + wgmma, built for
    decode's few rows per expert; bf16 activations, bf16 or block-scaled FP8 weights), for H100/H200s;
  - "ragged_dot": `jax.lax.ragged_dot` (the reference; a dense expansion on CPU and GPU);
  - "dense": no sorting; every token through every expert, weighted by a dense [T, E]
    weight matrix (E/k times the work; the simplest correct fallback and a benchmark arm);
  - "auto": "mgpu" on Hopper-class GPUs, "pallas" on other GPUs, "ragged_dot" elsewhere.
An engine picks it once, in its KernelConfig (mrv2_jax/config.py: `--kernels moe_backend=...`,
default from MRV2_MOE_BACKEND), and sets it on the model state (engine/builder.py).

Expert weights are stacked `[E, in, out]` (`gate_up` fuses gate and up along `out`); FP8
checkpoints add block scales `[E, in/128, out/128]`, applied inside the kernel or, for the
other backends, by dequantising first.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mrv2_jax.models.tensor_parallel import AXIS

BACKENDS = ("auto", "pallas", "mgpu", "ragged_dot", "dense")


def resolve_backend(backend: str | None = None) -> str:
    """`backend` (None: "auto") with "auto" made concrete for JAX's default backend."""
    backend = backend or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"MoE backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "ragged_dot"
    return backend


# --- routers ---------------------------------------------------------------------------

def softmax_topk_router(logits, top_k: int, normalize: bool):
    """Qwen3-MoE: softmax over all experts, keep the top k (renormalised if `normalize`).
    logits [T, E] -> (weights f32 [T, k], expert ids int32 [T, k]). Ties go to the lower id."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def grouped_sigmoid_router(logits, correction_bias, top_k: int, num_groups: int,
                           topk_groups: int, normalize: bool, scaling: float):
    """GLM-4.5 / DeepSeek-V3 routing: sigmoid scores; the choice adds a per-expert correction
    bias and is restricted to the `topk_groups` best expert groups (a group's score is the sum
    of its two best biased scores); the weights are the unbiased scores of the chosen experts,
    renormalised if `normalize`, times `scaling`. -> (weights f32 [T, k], ids int32 [T, k])."""
    t, e = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction_bias.astype(jnp.float32)
    if num_groups > 1:
        per_group = choice.reshape(t, num_groups, e // num_groups)
        best_two = jax.lax.top_k(per_group, min(2, e // num_groups))[0]
        _, groups = jax.lax.top_k(jnp.sum(best_two, axis=-1), topk_groups)
        keep = jnp.zeros((t, num_groups), bool).at[jnp.arange(t)[:, None], groups].set(True)
        choice = jnp.where(jnp.repeat(keep, e // num_groups, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, ids.astype(jnp.int32)


# --- experts ---------------------------------------------------------------------------

def _grouped(lhs, rhs, group_sizes, scale, backend, scale_block):
    from pallas_kernels import grouped_gemm as gg

    if backend == "pallas":
        return gg.grouped_gemm(lhs, rhs, group_sizes, scale, scale_block=scale_block,
                               interpret=jax.default_backend() != "gpu")
    if backend == "mgpu":  # imported here: Mosaic GPU's modules take a third of a second to import
        from pallas_kernels.grouped_gemm_mgpu import grouped_gemm_mgpu

        return grouped_gemm_mgpu(lhs, rhs, group_sizes, scale, scale_block=scale_block,
                                 interpret=jax.default_backend() != "gpu")
    return gg.grouped_gemm_reference(lhs, rhs, group_sizes, scale, scale_block=scale_block)


def routed_experts(x, weights, ids, gate_up, down, *, backend: str = "auto",
                   gate_up_scale=None, down_scale=None, scale_block: int = 128):
    """x [T, H], routing (weights f32 [T, k], ids int32 [T, k]), gate_up [E, H, 2I],
    down [E, I, H] -> [T, H]: sum over k of weight * SwiGLU-MLP of the chosen expert."""
    return _experts_f32(x, weights, ids, gate_up, down, backend, gate_up_scale, down_scale,
                        scale_block).astype(x.dtype)


def expert_parallel_experts(x, weights, ids, gate_up, down, mesh, *, backend: str = "auto",
                            gate_up_scale=None, down_scale=None, scale_block: int = 128):
    """`routed_experts` with the experts split whole over `mesh`'s AXIS (expert parallelism): the
    weights [E, ...] sharded on their expert axis, device d holding experts [d E/N, (d + 1) E/N);
    the tokens and their routing replicated (every device has all of them). Each device runs its
    own experts on the pairs routed to them, under `jax.shard_map` so that the grouped GEMM (the
    Pallas kernel on GPUs) sees only its local experts; pairs routed to another device's experts
    contribute zero there. One all-reduce sums the devices' partial outputs, in float32, rounded
    to x's dtype once after the sum (as one device rounds once after its f32 combine)."""
    experts = P(AXIS, None, None)  # [E, in, out] and FP8 scales [E, in/b, out/b]
    scales = tuple(s for s in (gate_up_scale, down_scale) if s is not None)

    def local(x, weights, ids, gate_up, down, scales):
        num_local = gate_up.shape[0]
        ids = ids - jax.lax.axis_index(AXIS) * num_local  # global expert id -> this device's
        # Pairs routed elsewhere get id num_local: sorted after every local group, they come out of
        # the grouped GEMM as zero rows (the dense backend drops them from its weight matrix).
        ids = jnp.where((ids >= 0) & (ids < num_local), ids, num_local)
        gu_scale, d_scale = scales if scales else (None, None)
        partial = _experts_f32(x, weights, ids, gate_up, down, backend, gu_scale, d_scale, scale_block)
        return jax.lax.psum(partial, AXIS)

    # check_vma off: the Pallas kernel inside carries no varying-axes annotations.
    out = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), experts, experts, (experts,) * len(scales)),
                        out_specs=P(), check_vma=False)(x, weights, ids, gate_up, down, scales)
    return out.astype(x.dtype)


def _experts_f32(x, weights, ids, gate_up, down, backend, gate_up_scale, down_scale, scale_block):
    """`routed_experts` before its final rounding: float32 [T, H]. An id equal to the number of
    experts (gate_up.shape[0]) names no expert: that pair contributes zero."""
    backend = resolve_backend(backend)
    if backend == "dense":
        return _dense_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale, scale_block)
    t, k = ids.shape
    num_experts = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # (token, slot) pairs sorted by expert
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    h = _grouped(x[order // k], gate_up, group_sizes, gate_up_scale, backend, scale_block)
    gate, up = jnp.split(h, 2, axis=-1)
    out = _grouped(jax.nn.silu(gate) * up, down, group_sizes, down_scale, backend, scale_block)
    # Un-permute: row j of `out` belongs to pair order[j]; gather back to pair order.
    unsorted = out[jnp.argsort(order)].reshape(t, k, -1)
    return jnp.einsum("tkh,tk->th", unsorted.astype(jnp.float32), weights)


def _dense_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale, scale_block):
    from pallas_kernels.grouped_gemm import dequantize_blocks

    if gate_up_scale is not None:
        gate_up = dequantize_blocks(gate_up, gate_up_scale, scale_block, x.dtype)
    if down_scale is not None:
        down = dequantize_blocks(down, down_scale, scale_block, x.dtype)
    num_experts = gate_up.shape[0]
    dense_w = jnp.zeros((x.shape[0], num_experts), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], ids].add(weights)
    # (No preferred_element_type: XLA's CPU dot rejects bf16 x bf16 -> f32 in these
    # contractions; GPUs accumulate bf16 dots in f32 anyway.)
    h = jnp.einsum("th,ehi->tei", x, gate_up.astype(x.dtype))
    gate, up = jnp.split(h, 2, axis=-1)
    out = jnp.einsum("tei,eih->teh", jax.nn.silu(gate) * up, down.astype(x.dtype))
    return jnp.einsum("teh,te->th", out.astype(jnp.float32), dense_w)
