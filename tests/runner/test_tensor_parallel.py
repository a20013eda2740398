"""Tensor parallelism (--tensor-parallel-size): greedy tokens at N = 2 and 4 equal N = 1's, the
weights and the KV cache sit where docs/parallelism.md says, a step communicates one all-reduce per
attention block and one per MLP block, and what is not supported yet is refused by name.

The engines run in a child process with 4 virtual CPU devices (tests/runner/tensor_parallel_run.py,
started through tests/runner/parallel_run.py with the other parallel modules' runs):
the rest of the suite keeps one CPU device, and XLA_FLAGS is read once per process."""

import numpy as np
import pytest

from mrv2_jax.engine.engine_config import EngineConfig
from mrv2_jax.models.tensor_parallel import interleave_shards, split_sharded
from tests.parity import FIXTURES, fixture_model_state, parallel_child


def child() -> dict:
    return parallel_child()["tp"]


@pytest.mark.parametrize("model,sizes", [("tiny", ("2",)), ("demo", ("2",)), ("wide", ("2", "4"))])
def test_greedy_tokens_equal_one_device(model, sizes):
    runs = child()[model]
    assert runs["1"]["preemptions"] > 0  # the prompts were sized to preempt
    for n in sizes:
        assert runs[n]["tokens"] == runs["1"]["tokens"], f"tensor_parallel_size={n}"
        assert runs[n]["preemptions"] == runs["1"]["preemptions"]
    assert child()["tiny"]["2"]["fused_calls"] > 0  # fused decode ran sharded too


def test_sampled_tokens_equal_one_device():
    """Seeded sampling with top-k/p, a penalty and logprobs: the noise is keyed by (seed, position)
    and the logits agree, so the tokens do too (the sampler runs replicated)."""
    tiny = child()["tiny"]
    assert tiny["2"]["sampled"] == tiny["1"]["sampled"]


def test_pallas_kernels_run_per_device_under_shard_map():
    """The KV write and ragged paged attention kernels (interpret mode), each device on its heads,
    match the jnp references on one device."""
    for case, error in child()["kernels"].items():
        assert error < 1e-5, case


def test_side_programs_keep_the_replicated_state():
    """Block-table overflow writes and grammar masks, compiled beside the step, take and give back
    the state where the step expects it."""
    for model, n in (("tiny", "2"), ("wide", "4")):
        assert child()[model][n]["side_programs"], (model, n)


def test_weights_and_kv_cache_are_split_as_documented():
    tiny = child()["tiny"]["2"]["placement"]  # 4 heads, 2 KV heads of 16, MLP 96, attention bias
    params = tiny["params"]
    column, row, replicated = "P(None, 'tp', None)", "P(None, None, 'tp')", "P()"  # weights [layers, out, in]
    assert params["layers.qkv_proj"] == [[2, 128, 64], column, [2, 64, 64]]
    assert params["layers.qkv_bias"] == [[2, 128], "P(None, 'tp')", [2, 64]]
    assert params["layers.gate_up_proj"] == [[2, 192, 64], column, [2, 96, 64]]
    assert params["layers.o_proj"] == [[2, 64, 64], row, [2, 64, 32]]
    assert params["layers.down_proj"] == [[2, 64, 96], row, [2, 64, 48]]
    for name in ("embed_tokens", "lm_head", "final_norm", "layers.input_norm", "layers.q_norm", "layers.o_bias"):
        assert params[name][1] == replicated and params[name][0] == params[name][2], name
    assert tiny["kv"] == [[2, 26, 2, 4, 16], "P(None, None, 'tp', None, None)", [2, 26, 1, 4, 16]]
    assert tiny["state"] == replicated
    wide = child()["wide"]["4"]["placement"]  # 8 heads, 4 KV heads: one per device
    assert wide["kv"][2] == [2, 26, 1, 4, 16]
    assert wide["params"]["layers.qkv_proj"][2] == [2, (8 + 2 * 4) * 16 // 4, 64]


def test_one_all_reduce_per_attention_and_per_mlp_block_and_donation_works():
    """The layer scan's body holds the step's only collectives: o_proj's and down_proj's sums, in
    f32 also for the bf16 model (rounded once after the sum, as one device's GEMM does)."""
    for model, n in (("tiny", "2"), ("demo", "2"), ("wide", "2"), ("wide", "4")):
        run = child()[model][n]
        assert run["collectives"], (model, n)
        for program, ops in run["collectives"].items():
            assert ops == {"all-reduce": 2, "all-gather": 0, "collective-permute": 0, "all-to-all": 0,
                           "reduce-scatter": 0, "all-reduce types": ["f32"]}, (model, n, program)
        assert run["warnings"] == [], (model, n)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_interleaved_layout_gives_each_device_whole_parts(n):
    """A fused weight in the per-device layout computes the same parts, and device d's columns hold
    piece d of every part."""
    rng = np.random.default_rng(0)
    widths = (32, 16, 16)
    x, w = rng.standard_normal((5, 8), np.float32), rng.standard_normal((8, 64), np.float32)
    parts = np.split(x @ w, np.cumsum(widths)[:-1], axis=-1)
    shuffled = np.asarray(interleave_shards(w, widths, n, axis=1))
    for got, want in zip(split_sharded(x @ shuffled, widths, n), parts):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    mine = shuffled[:, : 64 // n]  # device 0's columns: the first piece of each part
    np.testing.assert_array_equal(mine, np.concatenate([p[:, : p.shape[1] // n] for p in
                                                        np.split(w, np.cumsum(widths)[:-1], axis=1)], axis=1))


# --- what is refused, named by the flag ------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1"),
    (dict(tensor_parallel_size=2, runner="v1"), "tensor_parallel_size=2 needs the v2 runner"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "tensor_parallel_size=2 with speculative_config"),
    (dict(tensor_parallel_size=2, stream_in_call=True), "stream_in_call cannot run with tensor parallelism"),
])
def test_engine_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)



@pytest.mark.parametrize("fixture,n,config,message", [
    ("qwen3-moe-tiny", 2, {}, "tensor_parallel_size=2: Qwen3MoeForCausalLM is not supported yet"),
    ("glm4-moe-tiny", 2, {}, "tensor_parallel_size=2: MTP layers"),
    ("glm4-tiny", 2, {}, "Glm4ForCausalLM is not supported yet"),
    ("qwen3-tiny", 4, {}, "tensor_parallel_size=4 exceeds the model's 2 KV heads"),
    ("qwen3-tiny", 2, dict(num_attention_heads=6, num_key_value_heads=3),
     r"tensor_parallel_size=2 must divide the model's KV heads \(3\)"),
    ("qwen3-tiny", 4, dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=90),
     r"must divide the model's intermediate_size \(90\)"),
])
def test_models_it_cannot_split_are_refused(fixture, n, config, message):
    state = fixture_model_state(fixture, **config)
    with pytest.raises(ValueError, match=message):
        state.set_tensor_parallel(n)
    assert state.tp_size == 1


def test_more_devices_than_the_host_has_is_refused():
    from mrv2_jax.llm import LLM

    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 exceeds the 1 local device\(s\)"):
        LLM(str(FIXTURES / "qwen3-tiny"), tensor_parallel_size=2, dtype="float32", max_model_len=32,
            num_gpu_blocks=8, show_progress=False)


def test_cli_flag_and_data_parallel():
    from mrv2_jax.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "--prompt", "x", "--tensor-parallel-size", "2"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 2
    assert build_parser().parse_args(["generate", "--prompt", "x"]).tensor_parallel_size == 1
    pytest.importorskip("zmq")
    from mrv2_jax.data_parallel import EngineReplicas

    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported yet"):
        EngineReplicas({"tensor_parallel_size": 2}, 2)


def test_weights_split_for_another_size_are_refused():
    """An engine built over a loaded model that another engine split (benchmarks reuse one) must
    use the same size: the fused weights are in that size's layout."""
    from mrv2_jax.engine.builder import make_tensor_parallel

    state = fixture_model_state("qwen3-tiny")
    state.tp_size = 2  # as TensorParallel.shard_model leaves it
    for n in (1, 4):
        with pytest.raises(ValueError, match=f"tensor_parallel_size={n}: the loaded weights are split for 2"):
            make_tensor_parallel(n, state, lm=None)
