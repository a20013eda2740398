"""Speculative decoding: proposers draft k tokens per decoding request, the target verifies
them in one step, all on the device (see decoder.py for how it fits in a runner step)."""

from mrv2_jax.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
