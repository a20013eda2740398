"""The child process of tests/runner/test_pipeline_parallel.py: started with 4 virtual CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4), it runs tensor_parallel_run's requests at
pipeline_parallel_size 1 and 2 (and at 2 with a token count it does not divide) and prints one JSON
line: the tokens of each, the independent reference's, and at 2 where the arrays live and what the
compiled steps communicate."""

import json
import sys
import tempfile
from pathlib import Path

from mrv2_jax.llm import LLM
from tests.engine_reference import greedy_reference
from tests.parity import FIXTURES
from tests.runner.tensor_parallel_run import ENGINE, GREEDY, PROMPTS, SAMPLED, collectives, placement, sampled_variants


def moe_model(root: Path) -> Path:
    """qwen3-moe-tiny with 2 layers, both MoE (one layer group, so it splits into 2 stages); dummy
    weights."""
    config = json.loads((FIXTURES / "qwen3-moe-tiny" / "config.json").read_text())
    config |= {"num_hidden_layers": 2, "mlp_only_layers": [], "vocab_size": 96}  # 96: room for the prompts
    path = root / "qwen3-moe-tiny-2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def run(model, n: int, sample: bool = False, **extra) -> dict:
    llm = LLM(str(model), pipeline_parallel_size=n, **(ENGINE | sampled_variants(sample) | extra))
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
    sampled = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:3], SAMPLED)] if sample else None
    runner = llm.engine.runner
    out = {"tokens": tokens, "sampled": sampled, "fused_calls": runner.num_fused_calls,
           "preemptions": llm.engine.scheduler.num_preemptions}
    if n > 1:
        out |= {"collectives": collectives(runner)}
        if extra.get("runner") != "v1":  # v1 keeps its state on the host
            out["placement"] = placement(runner)
    return out


def results(one_device_tiny: dict | None = None) -> dict:
    """Every run's outputs; `one_device_tiny`: the tiny model's one-device run, when tensor_parallel_run
    made it already (its engine is this one's at pipeline_parallel_size 1)."""
    tiny = FIXTURES / "qwen3-tiny"
    with tempfile.TemporaryDirectory() as tmp:
        moe = moe_model(Path(tmp))
        return {"tiny": {1: one_device_tiny or run(tiny, 1, sample=True), 2: run(tiny, 2, sample=True)},
                # 7 tokens a step: 2 does not divide them, so each step runs as one micro-batch.
                "odd": run(tiny, 2, max_num_batched_tokens=7, max_num_seqs=7),
                "v1": run(tiny, 2, sample=True, runner="v1", max_fused_steps=1),
                "glm": {n: run(FIXTURES / "glm4-tiny", n, max_fused_steps=1) for n in (1, 2)},
                "glm_reference": [greedy_reference(FIXTURES / "glm4-tiny", p, GREEDY.max_tokens) for p in PROMPTS],
                "moe": {n: run(moe, n, load_format="dummy", max_fused_steps=1) for n in (1, 2)},
                "reference": [greedy_reference(tiny, p, GREEDY.max_tokens) for p in PROMPTS]}


def main() -> None:
    print(json.dumps(results()), file=sys.stdout)


if __name__ == "__main__":
    main()
