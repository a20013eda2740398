"""Imports every model family so that each registers its ModelState."""

from mrv2_jax.models import glm4, glm4_moe, qwen3, qwen3_moe  # noqa: F401
