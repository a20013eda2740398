"""Expert parallelism (--enable-expert-parallel with --tensor-parallel-size N, Qwen3-MoE): greedy
tokens at N = 2 and 4 equal N = 1's, each device holds num_experts / N whole experts, a step
communicates one all-reduce per attention block and one per MoE (or dense MLP) block and never
gathers the experts, and what is not supported is refused by name.

The engines run in a child process with 4 virtual CPU devices (tests/runner/expert_parallel_run.py,
started through tests/runner/parallel_run.py), the one tests/runner/test_tensor_parallel.py's run in."""

import pytest

from mrv2_jax.engine.engine_config import EngineConfig
from tests.parity import fixture_model_state, parallel_child


def child() -> dict:
    return parallel_child()["ep"]


@pytest.mark.parametrize("model,n", [("moe", "2"), ("wide", "4")])
def test_greedy_tokens_equal_one_device(model, n):
    runs = child()[model]
    assert runs["1"]["preemptions"] > 0  # the prompts were sized to preempt
    assert runs[n]["tokens"] == runs["1"]["tokens"], f"tensor_parallel_size={n} with enable_expert_parallel"
    assert runs[n]["preemptions"] == runs["1"]["preemptions"]
    assert runs[n]["side_programs"]
    assert child()["moe"]["2"]["fused_calls"] > 0  # fused decode ran with the experts split too


def test_each_device_holds_its_experts_whole():
    params = child()["moe"]["2"]["placement"]["params"]  # 8 experts, 2 MoE layers and 1 dense layer
    experts, column, row, replicated = ("P(None, 'tp', None, None)", "P(None, 'tp', None)", "P(None, None, 'tp')",
                                        "P()")  # dense weights [layers, out, in], experts [layers, E, in, out]
    assert params["moe_layers.experts_gate_up"] == [[2, 8, 32, 32], experts, [2, 4, 32, 32]]
    assert params["moe_layers.experts_down"] == [[2, 8, 16, 32], experts, [2, 4, 16, 32]]
    assert params["moe_layers.router"] == [[2, 8, 32], replicated, [2, 8, 32]]
    for group, layers in (("moe_layers", 2), ("dense_layers", 1)):  # attention as tensor parallelism splits it
        assert params[f"{group}.qkv_proj"] == [[layers, 128, 32], column, [layers, 64, 32]]
        assert params[f"{group}.o_proj"] == [[layers, 32, 64], row, [layers, 32, 32]]
        assert params[f"{group}.o_bias"][1] == replicated
    assert params["dense_layers.gate_up_proj"] == [[1, 96, 32], column, [1, 48, 32]]
    assert params["dense_layers.down_proj"] == [[1, 32, 48], row, [1, 32, 24]]
    assert child()["moe"]["2"]["placement"]["kv"][2] == [3, 26, 1, 4, 16]
    wide = child()["wide"]["4"]["placement"]["params"]
    assert wide["moe_layers.experts_gate_up"][2] == [2, 2, 32, 32]


def test_one_all_reduce_per_block_and_no_gathered_experts():
    """The wide model's one layer scan holds two all-reduces (o_proj's, the experts' partial sums);
    the fixture's three one-layer runs (MoE, dense, MoE) two each. All in f32, no other collective:
    the experts stay where they are."""
    for model, n, count in (("moe", "2", 6), ("wide", "4", 2)):
        run = child()[model][n]
        assert run["collectives"], (model, n)
        for program, ops in run["collectives"].items():
            assert ops == {"all-reduce": count, "all-gather": 0, "collective-permute": 0, "all-to-all": 0,
                           "reduce-scatter": 0, "all-reduce types": ["f32"]}, (model, n, program)
        assert run["warnings"] == [], (model, n)


def test_grouped_gemm_backends_under_shard_map():
    """The Pallas grouped GEMM (interpret mode) and the dense backend, each device on its own experts,
    match one device's within one bf16 rounding of the output (the f32 partial sums add up in
    another order)."""
    errors = child()["experts"]
    assert set(errors) == {"2 devices, pallas", "4 devices, dense"}
    for case, error in errors.items():
        assert error <= 1.0, case


# --- what is refused, named by the flag ------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(enable_expert_parallel=True), r"enable_expert_parallel needs tensor_parallel_size > 1"),
    (dict(enable_expert_parallel=1, tensor_parallel_size=2), "enable_expert_parallel must be a bool"),
    (dict(enable_expert_parallel=True, tensor_parallel_size=2, runner="v1"),
     "tensor_parallel_size=2 with enable_expert_parallel needs the v2 runner"),
    (dict(enable_expert_parallel=True, tensor_parallel_size=2,
          speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "tensor_parallel_size=2 with enable_expert_parallel with speculative_config"),
])
def test_engine_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)



FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("fixture,n,config,message", [
    ("qwen3-tiny", 2, {}, "enable_expert_parallel: Qwen3ForCausalLM has no experts"),
    ("glm4-tiny", 2, {}, "enable_expert_parallel: Glm4ForCausalLM has no experts"),
    ("glm4-moe-tiny-plain", 2, {}, "tensor_parallel_size=2: Glm4MoeForCausalLM is not supported yet"),
    ("glm4-moe-tiny", 2, {}, "tensor_parallel_size=2: MTP layers"),
    ("qwen3-moe-tiny", 2, dict(num_experts=6, num_experts_per_tok=2), None),  # 6 experts: 3 per device
    ("qwen3-moe-tiny", 2, dict(num_experts=5), r"enable_expert_parallel: tensor_parallel_size=2 must divide the "
                                               r"model's 5 experts"),
    ("qwen3-moe-tiny", 4, {}, "tensor_parallel_size=4 exceeds the model's 2 KV heads"),
    ("qwen3-moe-tiny", 2, dict(intermediate_size=47), r"must divide the model's intermediate_size \(47\)"),
    ("qwen3-moe-tiny", 2, dict(quantization_config=FP8), "FP8 checkpoints are not supported with tensor parallelism"),
])
def test_models_it_cannot_split_are_refused(fixture, n, config, message):
    state = fixture_model_state(fixture, **config)
    if message is None:
        assert "experts_gate_up" in state.check_tensor_parallel(n, expert_parallel=True)
        return
    with pytest.raises(ValueError, match=message):
        state.set_tensor_parallel(n, expert_mesh=object())  # refused before the mesh is looked at
    assert state.tp_size == 1 and state.expert_mesh is None


def test_dense_layers_only_need_not_divide_the_moe_model_intermediate_size():
    """intermediate_size is the dense layers' MLP: a model without dense layers does not split it."""
    state = fixture_model_state("qwen3-moe-tiny", mlp_only_layers=[], intermediate_size=47)
    assert "gate_up_proj" not in state.check_tensor_parallel(2, expert_parallel=True)


def test_cli_flag():
    from mrv2_jax.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "--prompt", "x", "--tensor-parallel-size", "2",
                                      "--enable-expert-parallel"])
    assert engine_kwargs(args)["enable_expert_parallel"] is True
    assert build_parser().parse_args(["generate", "--prompt", "x"]).enable_expert_parallel is False


def test_weights_split_without_experts_are_refused():
    """An engine over weights another engine split must split the experts the same way."""
    from mrv2_jax.engine.builder import make_tensor_parallel

    state = fixture_model_state("qwen3-moe-tiny")
    state.tp_size, state.expert_mesh = 2, object()  # as TensorParallel.shard_model leaves it with experts split
    with pytest.raises(ValueError, match="enable_expert_parallel=False: the loaded weights were split with it"):
        make_tensor_parallel(2, state, lm=None)
