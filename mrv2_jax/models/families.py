"""Imports every model family so that each registers its ModelState."""

from mrv2_jax.models import glm4, qwen3  # noqa: F401
