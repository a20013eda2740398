"""`--kernels decode_projections=mgpu`: which programs multiply the projection weights through the skinny
GEMM kernel (fused decode's, of at most KERNEL_MAX_TOKENS rows), and, on a GPU, the engine's greedy
tokens with it against the same engine on XLA's dot (the trained demo checkpoint in bf16, whose
margins are far from bf16 rounding; fused decode). On the CPU the kernel runs in Mosaic
GPU's interpreter, too slow for an engine (tests/models/test_projections.py checks the model there)."""

import gc
from pathlib import Path

import numpy as np
import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.models.projections import KERNEL_MAX_TOKENS, SkinnyProjection
from mrv2_jax.sampling_params import SamplingParams

DEMO = Path(__file__).parents[2] / "checkpoints" / "demo-qwen3"


def _llm(projections: str, max_fused_steps: int) -> LLM:
    return LLM(str(DEMO), runner="v2", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
               kernels=f"decode_projections={projections}", max_fused_steps=max_fused_steps, compile_mode="lazy",
               gpu_memory_utilization=0.3,
               show_progress=False)


def test_the_kernel_takes_fused_decode_s_small_buckets():
    runner = _llm("mgpu", 4).engine.runner
    assert any(b.num_reqs <= KERNEL_MAX_TOKENS for b in runner.fused_buckets)
    for bucket in runner.fused_buckets:
        projection = runner.projection_for(bucket)
        assert isinstance(projection, SkinnyProjection) == (bucket.num_reqs <= KERNEL_MAX_TOKENS), bucket
    assert all(_llm("xla", 4).engine.runner.projection_for(b) is None for b in runner.fused_buckets)


@pytest.mark.gpu
@pytest.mark.parametrize("max_fused_steps", [4, 8])
def test_greedy_tokens_equal_xla_s(max_fused_steps):
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 2000, n)] for n in (8, 16, 5, 40)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    tokens = {}
    for projections in ("xla", "mgpu"):
        llm = _llm(projections, max_fused_steps)
        tokens[projections] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()  # free the KV cache for the next engine
    assert all(len(t) == 48 for t in tokens["xla"])
    assert tokens["mgpu"] == tokens["xla"]
