"""`--step-twins` (runner/step_twins.py): a step program and its twin, called in turn, decode what the
program alone decodes (GPUs); where the twins cannot be made, the engine says so at its start."""

import jax
import pytest

from mrv2_jax.engine.engine_config import EngineConfig
from mrv2_jax.llm import LLM
from mrv2_jax.runner.step_twins import StepTwins
from mrv2_jax.sampling_params import SamplingParams


def test_step_twins_take_turns_per_program(monkeypatch):
    """Each program alternates with its own twin, made once, at its first call. (The twin here stands
    in for a loaded copy: XLA:CPU cannot serialize a program; the GPU test below makes real ones.)"""
    import mrv2_jax.runner.step_twins as step_twins

    made = {}
    monkeypatch.setattr(step_twins, "load_twin", lambda program: made.setdefault(program, object()))
    twins = StepTwins()
    a, b = object(), object()
    calls = [twins.pick(a), twins.pick(b), twins.pick(a), twins.pick(a), twins.pick(b)]
    assert calls == [a, b, made[a], a, made[b]] and list(made) == [a, b] and len(twins) == 2


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's refusal")
def test_an_engine_without_a_gpu_refuses_step_twins_at_start():
    with pytest.raises(ValueError, match="step_twins needs one GPU"):
        LLM("demo", max_num_seqs=2, max_model_len=64, step_twins=True, show_progress=False)


@pytest.mark.parametrize("other", [{"runner": "v1"}, {"pipeline_parallel_size": 2}])
def test_step_twins_need_the_v2_runner_on_one_device(other):
    with pytest.raises(ValueError, match="step_twins needs the v2 runner on one device"):
        EngineConfig(model="demo", step_twins=True, **other)


@pytest.mark.gpu  # XLA:CPU cannot serialize the step programs, so they have no twins there
def test_a_step_program_and_its_twin_in_turn_decode_what_the_program_alone_decodes():
    def greedy(step_twins: bool):
        llm = LLM("demo", max_num_seqs=2, max_model_len=128, max_fused_steps=1, step_twins=step_twins,
                  show_progress=False)
        outputs = llm.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=24, temperature=0.0,
                                                                          ignore_eos=True), use_tqdm=False)
        twins = llm.engine.runner.step_twins
        return [o.outputs[0].token_ids for o in outputs], 0 if twins is None else len(twins)

    alone, _ = greedy(False)
    in_turn, made = greedy(True)
    assert made > 0 and in_turn == alone
