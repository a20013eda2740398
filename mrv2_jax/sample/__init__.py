"""Sampling on the device: see sampler.py for the pipeline and features.py for feature flags and
kernel choices."""

from mrv2_jax.sample.features import SamplerFeatures, SamplerKernels
from mrv2_jax.sample.penalties import PenaltyData
from mrv2_jax.sample.sampler import SamplerOutput, sample, sample_tokens
from mrv2_jax.sample.tensors import SamplingRow, SamplingTable, SamplingTensors, sampling_row

__all__ = ["PenaltyData", "SamplerFeatures", "SamplerKernels", "SamplerOutput", "SamplingRow", "SamplingTable",
           "SamplingTensors", "sample", "sample_tokens", "sampling_row"]
