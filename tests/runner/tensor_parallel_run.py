"""The child process of tests/runner/test_tensor_parallel.py: started with 4 virtual CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4, which the rest of the suite must not see),
it runs the same greedy requests at tensor_parallel_size 1, 2 (and 4 where the heads allow) and
prints one JSON line: the tokens of each, and at N > 1 where the arrays live and what the
compiled steps communicate."""

import json
import sys
import tempfile
import warnings
from pathlib import Path

from mrv2_jax.llm import LLM
from mrv2_jax.sampling_params import SamplingParams
from tests.parity import FIXTURES

# 26 blocks of 4 tokens for these prompts force a preemption; 8 tokens a step split the long prompt.
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96, num_gpu_blocks=26,
              block_size=4, show_progress=False, sampler_variants="greedy,all", compile_mode="lazy")
PROMPTS = [[3, 5, 7, 9, 11], list(range(10, 40)), [4, 8], list(range(50, 70)), [60, 61, 62, 1, 2, 3, 4]]
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


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
             __import__("jax").tree.flatten_with_path(runner.params.treedef.unflatten(runner.params.leaves))[0]]
    return {"params": dict(zip(names, map(one, runner.params.leaves))), "kv": one(runner.kv_cache[0]),
            "state": str(runner.state.token_ids.sharding.spec)}


def collectives(runner) -> dict:
    """Collective ops in every compiled step program, by kind."""
    counts = {}
    for kind, programs in (("step", runner.compiled), ("fused", runner.fused)):
        for bucket, (_, variants) in programs.items():
            for i, program in enumerate(variants._programs):
                if program is not None:
                    text = program.as_text()
                    counts[f"{kind} {bucket.num_tokens}x{bucket.num_reqs} v{i}"] = {
                        op: text.count(f"{op}(") for op in ("all-reduce", "all-gather", "collective-permute",
                                                            "all-to-all", "reduce-scatter")}
    return counts


def run(model, n: int, **extra) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(model), tensor_parallel_size=n, **(ENGINE | extra))
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
    runner = llm.engine.runner
    out = {"tokens": tokens, "fused_calls": runner.num_fused_calls,
           "preemptions": llm.engine.scheduler.num_preemptions,
           "warnings": [str(w.message)[:300] for w in caught if "donat" in str(w.message)]}
    if n > 1:
        out |= {"placement": placement(runner), "collectives": collectives(runner)}
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wide = wide_model(Path(tmp))
        # Fused decode (the default) on the fixture, one step per call on the wide model.
        result = {"tiny": {n: run(FIXTURES / "qwen3-tiny", n) for n in (1, 2)},
                  "wide": {n: run(wide, n, load_format="dummy", max_fused_steps=1) for n in (1, 2, 4)}}
    print(json.dumps(result), file=sys.stdout)


if __name__ == "__main__":
    main()
