"""The declared runner interface (runner/interface.py): both runners and what their steps return
provide it, and the engine uses nothing of a runner beyond it."""

import ast
from pathlib import Path

import jax.numpy as jnp
import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.runner import v2
from mrv2_jax.runner.interface import Runner, StepOutcome
from mrv2_jax.runner.step_result import StepResult
from mrv2_jax.sample.sampler import SamplerOutput
from mrv2_jax.sampling_params import SamplingParams
from tests.parity import FIXTURES

MODEL = FIXTURES / "qwen3-tiny"
PACKAGE = Path(__file__).resolve().parents[2] / "mrv2_jax"
# The code that holds a runner: the engine and everything above it.
ENGINE_FILES = sorted([*(PACKAGE / "engine").glob("*.py"), PACKAGE / "llm.py", PACKAGE / "async_llm.py",
                       *(PACKAGE / "entrypoints").glob("*.py")])


def protocol_members(protocol) -> set[str]:
    declared = set(protocol.__annotations__)
    methods = {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}
    return declared | methods


def small_llm(runner: str, **overrides) -> LLM:
    """One token bucket and two sampler variants: a quick compile. The shape of test_prompt_logprobs'
    preemption engines, whose `all` step programs (what a logprobs batch runs) are then shared through
    the persistent compilation cache."""
    args = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=8, max_model_len=48, num_gpu_blocks=12,
                block_size=4, show_progress=False, sampler_variants="greedy,all")
    return LLM(str(MODEL), runner=runner, **(args | overrides))


# Fused decode at the default K (16): test_prompt_logprobs' v2 engine compiles the same fused program.
@pytest.mark.parametrize("runner, overrides", [("v1", {}), ("v2", {"max_fused_steps": 1}),
                                               ("v2", {"max_fused_steps": 16})])
def test_runners_provide_the_interface_and_steps_return_outcomes(runner, overrides, monkeypatch):
    llm = small_llm(runner, **overrides)
    model_runner = llm.engine.runner
    assert isinstance(model_runner, Runner)
    assert model_runner.is_async_capable == (runner == "v2")
    assert model_runner.supports_prompt_logprobs  # no spec decoder, and "all" computes them
    fuses = overrides.get("max_fused_steps", 1) > 1
    assert (model_runner.max_fused_rows > 0) == fuses
    outcomes = []
    execute = model_runner.execute
    monkeypatch.setattr(model_runner, "execute", lambda out: outcomes.append(execute(out)) or outcomes[-1])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert outcomes and all(isinstance(outcome, StepOutcome) for outcome in outcomes)
    assert (model_runner.num_fused_calls > 0) == fuses


def test_both_step_results_provide_the_outcome_interface():
    assert isinstance(StepResult({"a": [1]}), StepOutcome)
    pending = v2.PendingStep(SamplerOutput(jnp.array([3, 4], jnp.int32)), ["a", "b"], {"a"}, {})
    assert isinstance(pending, StepOutcome)
    assert pending.result() == {"a": [3]} and pending.logprobs() == {} and pending.prompt_logprobs() == {}


def runner_attributes(tree: ast.AST) -> set[str]:
    """Attributes read on `runner`, `self.runner` or `<anything>.engine.runner` in a module."""
    def is_runner(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "runner") or (
            isinstance(node, ast.Attribute) and node.attr == "runner")

    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_runner(node.value)}


def test_engine_uses_only_the_declared_runner_interface():
    members = protocol_members(Runner)
    assert members == {"is_async_capable", "supports_prompt_logprobs", "max_fused_rows", "num_fused_calls",
                       "automaton_capacity", "automaton_pool", "eos_token_ids", "stream_in_call", "token_sink",
                       "num_programs_pending", "call_seconds", "execute", "warm_up", "wait_for_compiles"}
    used = set()
    for path in ENGINE_FILES:
        text = path.read_text()
        for probe in ("getattr(runner", "getattr(self.runner", "hasattr(runner", "hasattr(self.runner",
                      "hasattr(result"):
            assert probe not in text, f"{path.name}: {probe} (declare it in runner/interface.py instead)"
        used |= runner_attributes(ast.parse(text))
    assert "execute" in used and used <= members, used - members
    assert protocol_members(StepOutcome) == {"result", "logprobs", "prompt_logprobs"}
