"""The child process of tests/runner/test_tensor_parallel.py: started with 4 virtual CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4, which the rest of the suite must not see),
it runs the same greedy requests at tensor_parallel_size 1, 2 (and 4 where the heads allow) and
prints one JSON line: the tokens of each, and at N > 1 where the arrays live and what the
compiled steps communicate. On 2+ GPUs (scripts/gpu_check.sh tp) it runs as it is, with the
Pallas kernels compiled, and sizes up to the GPU count."""

import json
import re
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mrv2_jax.llm import LLM
from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.models.tensor_parallel import AXIS
from mrv2_jax.runner import grammar_masks, v2
from mrv2_jax.sampling_params import SamplingParams
from tests.parity import FIXTURES

# 26 blocks of 4 tokens for these prompts force a preemption; 8 tokens a step split the long prompt.
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=8, max_model_len=96, num_gpu_blocks=26,
              block_size=4, show_progress=False, sampler_variants="greedy,all", compile_mode="lazy")
PROMPTS = [[3, 5, 7, 9, 11], list(range(10, 40)), [4, 8], list(range(50, 70)), [60, 61, 62, 1, 2, 3, 4]]
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
# The sampler's widest variant: seeded noise, top-k/p, penalties, logprobs.
SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.5, seed=7,
                         logprobs=2, ignore_eos=True)


def wide_model(root: Path) -> Path:
    """qwen3-tiny with 8 heads and 4 KV heads (dummy weights), so that 4 devices hold one KV head
    each; no attention bias, the other branch of the family's layout."""
    config = json.loads((FIXTURES / "qwen3-tiny" / "config.json").read_text())
    config |= {"num_attention_heads": 8, "num_key_value_heads": 4, "attention_bias": False}
    path = root / "qwen3-tiny-wide"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def placement(runner) -> dict:
    """Per parameter leaf: (global shape, partition spec, one device's shard shape); the KV cache's."""
    def one(a):
        return [list(a.shape), str(a.sharding.spec), list(a.addressable_shards[0].data.shape)]

    names = [".".join(str(k.key) for k in path[:-1]) for path, _ in
             jax.tree.flatten_with_path(runner.params.treedef.unflatten(runner.params.leaves))[0]]
    return {"params": dict(zip(names, map(one, runner.params.leaves))), "kv": one(runner.kv_cache[0]),
            "state": str(runner.state.token_ids.sharding.spec)}


def collectives(runner) -> dict:
    """Collective ops in every compiled step program, by kind."""
    counts = {}
    for kind, programs in (("step", runner.compiled), ("fused", getattr(runner, "fused", {}))):  # v1: no fused
        for bucket, (_, variants) in programs.items():
            for i, program in enumerate(variants._programs):
                if program is not None:
                    text = program.as_text()
                    ops = {op: text.count(f"{op}(") for op in ("all-reduce", "all-gather", "collective-permute",
                                                               "all-to-all", "reduce-scatter")}
                    ops["all-reduce types"] = sorted(set(re.findall(r"= (\w+)\[[^\]]*\]\S* all-reduce\(", text)))
                    counts[f"{kind} {bucket.num_tokens}x{bucket.num_reqs} v{i}"] = ops
    return counts


def side_programs_run(runner) -> bool:
    """The runner's small programs beside the step (block-table overflow, grammar masks) take the
    replicated state and give it back where the step expects it."""
    entries = np.full(v2.OVERFLOW_CHUNK, -1, np.int32)
    state = runner._block_writes(runner.state, entries, entries, entries)
    masks = grammar_masks.GrammarMasks(runner.slot_state.automata, eager=True)
    tables = masks._compiled()(runner.slot_state.automata, np.full(grammar_masks.MASK_ROWS, -1, np.int32),
                               np.zeros((grammar_masks.MASK_ROWS, masks._w), np.uint32))
    runner.state, runner.slot_state = state, runner.slot_state._replace(automata=tables)
    same = lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim)  # noqa: E731
    return all(jax.tree.leaves(jax.tree.map(same, state, runner.state))) and same(tables.allowed, tables.allowed)


def sampled_variants(sample: bool) -> dict:
    """An engine that serves sampled requests compiles only the widest sampler variant ("all"), which
    its greedy requests run through too: two step programs (step and fused) instead of four."""
    return {"sampler_variants": "all"} if sample else {}


def run(model, n: int, sample: bool = False, prompts=PROMPTS, **extra) -> dict:
    """The greedy requests at `n` devices; `sample`: then a few seeded sampled ones (the sampler's
    widest program: it compiles for seconds, so only on one model, whose greedy requests then run
    through it too)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(model), tensor_parallel_size=n, **(ENGINE | sampled_variants(sample) | extra))
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
        runner = llm.engine.runner
        side_ok = n == 1 or side_programs_run(runner)
        sampled = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:3], SAMPLED)] if sample else None
    out = {"tokens": tokens, "sampled": sampled, "side_programs": side_ok, "fused_calls": runner.num_fused_calls,
           "preemptions": llm.engine.scheduler.num_preemptions,
           "warnings": [str(w.message)[:300] for w in caught if "donat" in str(w.message)]}
    if n > 1:
        out |= {"placement": placement(runner), "collectives": collectives(runner)}
    return out


def random_attention_case(seed: int = 0):
    """A random paged-attention call's arrays: (K cache, V cache) of 2 layers x 8 blocks x 2 KV heads
    x 4 slots x 16 dims, and q, k, v for 8 tokens (4 query heads) -> (caches, q, k, v)."""
    rng = np.random.default_rng(seed)
    layers, blocks, kv_heads, block_size, dim, heads, tokens = 2, 8, 2, 4, 16, 4, 8
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    caches = (rand(layers, blocks, kv_heads, block_size, dim), rand(layers, blocks, kv_heads, block_size, dim))
    return caches, rand(tokens, heads, dim), rand(tokens, kv_heads, dim), rand(tokens, kv_heads, dim)


def i32(values):
    return jnp.asarray(values, jnp.int32)


def kernels_under_shard_map() -> dict:
    """One paged attention call (KV write + ragged paged attention) with the Pallas kernels in
    interpret mode, over 2 devices and over one: -> the largest difference of (out, K, V) from the
    jnp references on one device."""
    caches, q, k, v = random_attention_case()
    # Row 0: positions 4..8 of a 9-token context in blocks 1, 2, 3; row 1: a 3-token prompt in block 5.
    meta = (i32([8, 9, 10, 11, 12, 20, 21, 22]), i32([[1, 2, 3, 0], [5, 0, 0, 0]]), i32([9, 3]), i32([0, 5, 8]),
            i32(2))

    def call(mesh, kernels):
        attention = PagedAttention(*meta, use_kernels=kernels, interpret=kernels and not on_gpu, mesh=mesh)
        return jax.jit(lambda q, k, v, caches: attention(q, k, v, jnp.int32(1), caches, 0.25))(q, k, v, caches)

    on_gpu = jax.default_backend() == "gpu"  # scripts/gpu_check.sh tp: the compiled kernels
    reference = jax.tree.leaves(call(None, False))
    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    return {f"{'2 devices' if m else '1 device'}, {'kernels' if kern else 'reference'}":
            max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(call(m, kern)), reference))
            for m in (None, mesh) for kern in (False, True)}


def results() -> dict:
    """Every run's outputs and the kernels' differences."""
    with tempfile.TemporaryDirectory() as tmp:
        wide = wide_model(Path(tmp))
        # Fused decode (the default) on the fixture, one step per call on the demo and wide models.
        return {"tiny": {n: run(FIXTURES / "qwen3-tiny", n, sample=True) for n in (1, 2)},
                # The trained demo model in bf16 (4 heads, 2 KV heads): real logit gaps, bf16 sums.
                "demo": {n: run("demo", n, dtype="bfloat16", max_fused_steps=1) for n in (1, 2)},
                "wide": {n: run(wide, n, load_format="dummy", max_fused_steps=1) for n in (1, 2, 4)
                         if n <= jax.device_count()},
                "kernels": kernels_under_shard_map()}


def main() -> None:
    print(json.dumps(results()), file=sys.stdout)


if __name__ == "__main__":
    main()
