"""mrv2-jax: a JAX/XLA inference engine for Qwen and GLM models (vLLM Model Runner V2 ideas)."""

from mrv2_jax.xla_flags import apply_default_xla_flags

apply_default_xla_flags()

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    # Lazy, so that `import mrv2_jax.models...` does not pull in the whole engine.
    if name == "LLM":
        from mrv2_jax.llm import LLM

        return LLM
    if name == "SamplingParams":
        from mrv2_jax.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'mrv2_jax' has no attribute {name!r}")
