"""Pipeline parallelism (--pipeline-parallel-size): greedy tokens at 2 stages equal one device's and the
independent dense reference's, the layer weights and the KV cache are split on their layer axis,
a step passes the hidden states between the stages, and what is not supported yet is refused by name.

The engines run in a child process with 4 virtual CPU devices (tests/runner/pipeline_parallel_run.py,
started through tests/runner/parallel_run.py with the other parallel modules' runs):
the rest of the suite keeps one CPU device, and XLA_FLAGS is read once per process."""

import pytest

from mrv2_jax.engine.engine_config import EngineConfig
from tests.parity import FIXTURES, fixture_model_state, parallel_child


def child() -> dict:
    return parallel_child()["pp"]


@pytest.mark.parametrize("model", ["tiny", "moe", "glm"])
def test_greedy_tokens_equal_one_device(model):
    runs = child()[model]
    assert runs["1"]["preemptions"] > 0  # the prompts were sized to preempt
    assert runs["2"]["tokens"] == runs["1"]["tokens"]
    assert runs["2"]["preemptions"] == runs["1"]["preemptions"]


def test_greedy_tokens_equal_the_dense_reference():
    assert child()["tiny"]["2"]["tokens"] == child()["reference"]
    assert child()["glm"]["2"]["tokens"] == child()["glm_reference"]  # GLM-4: partial rotary, extra norms
    assert child()["tiny"]["2"]["fused_calls"] > 0  # fused decode ran in stages too


def test_the_v1_runner_runs_in_stages_too():
    """v1 (host-built inputs, no fused decode) at PP = 2: the dense reference's tokens, with the
    sampler's widest variant as on one device."""
    v1 = child()["v1"]
    assert v1["tokens"] == child()["reference"] and v1["sampled"] == child()["tiny"]["1"]["sampled"]
    assert v1["collectives"]  # the step ran in stages


def test_steps_of_a_token_count_the_stages_do_not_divide_run_as_one_micro_batch():
    odd = child()["odd"]
    assert odd["tokens"] == child()["reference"]
    for program, ops in odd["collectives"].items():
        assert ops["collective-permute"] == 1 and ops["all-reduce"] == 1, program


def test_sampled_tokens_equal_one_device():
    tiny = child()["tiny"]
    assert tiny["2"]["sampled"] == tiny["1"]["sampled"]


def test_layers_and_kv_cache_are_split_on_the_layer_axis():
    placement = child()["tiny"]["2"]["placement"]
    for name, (shape, spec, shard) in placement["params"].items():
        if name.startswith("layers."):
            assert spec == "P('pp',)" and shard == [shape[0] // 2, *shape[1:]], name
        else:
            assert spec == "P()" and shard == shape, name
    assert placement["kv"] == [[2, 26, 2, 4, 16], "P('pp',)", [1, 26, 2, 4, 16]]
    assert placement["state"] == "P()"
    assert child()["moe"]["2"]["placement"]["kv"][2][0] == 1


def test_micro_batches_hand_over_and_one_broadcast_per_step():
    """The step's 8 tokens run as 2 micro-batches: stage 0 hands each to stage 1 (a collective
    permute each); the last stage's outputs reach every device by one all-reduce of them and zeros."""
    for model in ("tiny", "moe"):
        programs = child()[model]["2"]["collectives"]
        assert programs, model
        for program, ops in programs.items():
            assert ops["collective-permute"] == 2 and ops["all-reduce"] == 1, (model, program)
            assert ops["all-gather"] == ops["all-to-all"] == ops["reduce-scatter"] == 0, (model, program)


@pytest.mark.parametrize("kernels", [False, True])
def test_micro_batch_attention_equals_the_whole_batch(kernels):
    """Two micro-batches attended one after the other (the second finding the first's K/V in the
    cache) give the whole batch's output and cache, with a row cut by the boundary and a row wholly
    in each half; `kernels`: the Pallas kernels in interpret mode."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mrv2_jax.models.attention import PagedAttention
    from tests.runner.tensor_parallel_run import i32, random_attention_case

    caches, q, k, v = random_attention_case()
    half = q.shape[0] // 2
    # Row 0: a decode token at position 6 (blocks 1, 2); row 1: a 5-token chunk at positions 4..8 of 9
    # (blocks 3, 4, 6: cut 3 | 2 by the boundary); row 2: a 2-token prompt in block 5.
    whole = PagedAttention(i32([10, 16, 17, 18, 19, 24, 20, 21]), i32([[1, 2, 0], [3, 4, 6], [5, 0, 0]]),
                           i32([7, 9, 2]), i32([0, 1, 6, 8]), i32(3), use_kernels=kernels, interpret=kernels)

    @jax.jit
    def both(q, k, v, caches):
        out, caches_whole = whole(q, k, v, jnp.int32(1), caches, 0.25)
        parts = []
        for start in (0, half):
            piece = slice(start, start + half)
            part, caches = whole.micro_batch(start, half)(q[piece], k[piece], v[piece], jnp.int32(1), caches, 0.25)
            parts.append(part)
        return out, caches_whole, jnp.concatenate(parts), caches

    out, caches_whole, out_parts, caches_parts = both(q, k, v, caches)
    np.testing.assert_allclose(np.asarray(out_parts), np.asarray(out), atol=1e-5)
    for a, b in zip(caches_parts, caches_whole):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- what is refused, named by the flag ------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be an int >= 1"),
    (dict(pipeline_parallel_size="2"), "pipeline_parallel_size must be an int >= 1"),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=2), "pipeline_parallel_size=2 with tensor_parallel_size=2"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "pipeline_parallel_size=2 with speculative_config"),
    (dict(pipeline_parallel_size=2, stream_in_call=True), "pipeline_parallel_size=2: stream_in_call"),
    (dict(pipeline_parallel_size=2, program_store=True), "pipeline_parallel_size=2 with program_store"),
    (dict(pipeline_parallel_size=2, num_processes=2), "pipeline_parallel_size=2 over several processes"),
])
def test_engine_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("fixture,n,config,message", [
    ("qwen3-tiny", 4, {}, r"pipeline_parallel_size=4 must divide the model's num_hidden_layers \(2\)"),
    ("qwen3-tiny", 2, dict(num_hidden_layers=3), r"must divide the model's num_hidden_layers \(3\)"),
    ("qwen3-moe-tiny", 2, {}, "pipeline_parallel_size=2: models with several layer groups"),
    ("glm4-moe-tiny", 2, {}, "pipeline_parallel_size=2: MTP layers"),
])
def test_models_it_cannot_split_are_refused(fixture, n, config, message):
    with pytest.raises(ValueError, match=message):
        fixture_model_state(fixture, **config).check_pipeline_parallel(n)


def test_more_devices_than_the_host_has_is_refused():
    from mrv2_jax.llm import LLM

    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 exceeds the 1 local device\(s\)"):
        LLM(str(FIXTURES / "qwen3-tiny"), pipeline_parallel_size=2, dtype="float32", max_model_len=32,
            num_gpu_blocks=8, show_progress=False)


def test_cli_flag_and_data_parallel():
    from mrv2_jax.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "--prompt", "x", "--pipeline-parallel-size", "2"])
    assert engine_kwargs(args)["pipeline_parallel_size"] == 2
    assert build_parser().parse_args(["generate", "--prompt", "x"]).pipeline_parallel_size == 1
    pytest.importorskip("zmq")
    from mrv2_jax.data_parallel import EngineReplicas

    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 is not supported yet"):
        EngineReplicas({"pipeline_parallel_size": 2}, 2)


def test_weights_split_into_stages_are_refused():
    """An engine built over a loaded model that another engine split into stages (benchmarks reuse
    one) is refused, whatever its size: its weights and decoder are set up for that mesh."""
    from types import SimpleNamespace

    from mrv2_jax.engine.builder import make_pipeline_parallel

    split = SimpleNamespace(pipeline_mesh=object())
    for n in (1, 2):
        with pytest.raises(ValueError, match=f"pipeline_parallel_size={n}: the loaded weights are split into stages"):
            make_pipeline_parallel(n, fixture_model_state("qwen3-tiny"), split)
