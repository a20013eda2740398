"""On a GPU, a KV cache that fills most of the device's memory: greedy tokens still equal a plain
loop's, one step per call and fused, with the small buckets' layers unrolled. XLA:GPU rewrote such
step programs of Qwen3-0.6B to save memory they did not need and lost each step's token-count
update (mrv2_jax/xla_flags.py); small KV caches, as every other test uses, never reach that rewrite,
and neither did the demo model's smaller programs."""

import gc

import jax
import numpy as np
import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.sampling_params import SamplingParams
from tests.engine_reference import greedy_reference

MODEL = "qwen3-0.6b"  # a preset: config only, seeded random weights on both sides


@pytest.mark.gpu
@pytest.mark.parametrize("max_fused_steps", [1, 8])
def test_greedy_tokens_match_a_plain_loop_with_the_kv_cache_filling_the_gpu(max_fused_steps):
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 30000, n)] for n in (8, 16, 5)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(MODEL, load_format="dummy", dtype="float32", runner="v2", max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, block_size=16, gpu_memory_utilization=0.9, unrolled_layers_max_tokens=64,
              compile_mode="lazy", max_fused_steps=max_fused_steps, sampler_variants="greedy,all",
              show_progress=False)
    kv_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.kv_cache))
    device_bytes = jax.devices()[0].memory_stats()["bytes_limit"]
    assert kv_bytes > 0.5 * device_bytes  # the regime this test is about
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()  # free the KV cache for the plain loop and the next case
    assert got == [greedy_reference(MODEL, p, 16, load_format="dummy") for p in prompts]
