"""Pallas (Triton backend) GPU kernels, each next to a pure-jnp reference of the same signature.

- ``pallas_kernels.kv_write``: ``write_kv`` / ``write_kv_reference`` (slot-mapped cache update).
- ``pallas_kernels.ragged_paged_attention``: ``ragged_paged_attention`` /
  ``ragged_paged_attention_reference`` (mixed prefill/decode attention over the paged cache).

The functions are deliberately not re-exported here: ``ragged_paged_attention`` is both a
module and a function name, and re-exporting the function would shadow the module for
``from pallas_kernels import ragged_paged_attention``.
"""
