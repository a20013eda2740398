"""Pallas GPU kernels (Triton backend; Mosaic GPU where noted), each next to a pure-jnp reference of
the same signature.

The bottom layer: these modules import only jax, numpy, the standard library and each other, and
their kernels take arrays and return arrays; mrv2_jax adapts its own types to them.

- ``kv_write``: ``write_kv`` / ``write_kv_reference`` (slot-mapped cache update).
- ``qk_norm_rope_kv_write``: ``qk_norm_rope_kv_write`` / ``..._reference`` (from the fused qkv projection:
  q/k RMSNorm, halves RoPE, q out and K/V into the cache in one kernel; the paged attention's
  ``attend_qkv`` on one device).
- ``kv_write_mgpu``: ``write_kv_mgpu``, the same update on the Mosaic GPU backend (issue 27; not yet
  used by the engine).
- ``gemv_triton``: ``gemv`` / ``gemv_reference`` (decode's projection of one row, or up to 32, from an
  ``[N, K]`` weight with the RMSNorm before it and a residual add or SwiGLU after it in the same kernel,
  no split of K; Triton, issue 26; fused decode's one-row bucket with ``--kernels
  decode_projections=gemv``, through mrv2_jax/models/gemv_projections.py).
- ``ragged_paged_attention``: ``ragged_paged_attention`` / ``ragged_paged_attention_reference``
  (mixed prefill/decode attention over the paged cache).
- ``ragged_paged_attention_mgpu``: ``ragged_paged_attention_mgpu``, the same attention on Mosaic GPU
  (issue 27; every non-fused step's attention with ``--kernels ragged_attention=mgpu``, not the default).
- ``paged_decode_attention_mgpu``: ``paged_decode_attention_mgpu``, decode-only attention over the paged cache
  on Mosaic GPU (issue 27; fused decode's attention with ``--kernels decode_attention=mgpu``, not the default).
- ``grouped_gemm``: ``grouped_gemm`` / ``grouped_gemm_reference`` (the MoE experts' GEMMs).
- ``grouped_gemm_mgpu``: ``grouped_gemm_mgpu``, the same GEMMs on Mosaic GPU for decode's few rows per
  expert (issue 27; the engine's ``moe_backend=mgpu``, its default on Hopper-class GPUs).
- ``logit_stats``: the sampler's one pass over the logits (``logit_stats``, ``count_above``).
- ``noise_pass``: the sampler's whole-row noise pass; ``threshold_search``: its slow path.
- ``mgpu_common``: what the Mosaic GPU kernels share (the SM count their configs plan for, wgmma tile rules).
- ``sampler_common``, ``gumbel_hash``: the constants and jnp math the sampler kernels share with
  mrv2_jax/sample, so that both sides compute the same bits.

The functions are deliberately not re-exported here: ``ragged_paged_attention`` is both a
module and a function name, and re-exporting the function would shadow the module for
``from pallas_kernels import ragged_paged_attention``.
"""
