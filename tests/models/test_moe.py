"""MoE families: routing against a numpy reference (edge cases included), expert backends
against each other, MTP layer parity with Hugging Face, paged == dense, save/load."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mrv2_jax.models.attention import DenseAttention
from mrv2_jax.models.loader import load_model, save_hf_checkpoint
from mrv2_jax.models.moe import (
    grouped_sigmoid_router,
    routed_experts,
    softmax_topk_router,
)
from mrv2_jax.models.qwen3_moe import Qwen3MoeModelState
from mrv2_jax.runner.kv_cache import allocate_kv_cache
from tests.parity import FIXTURES, dense_logits, load_expected, max_logit_error, paged_chunk_logits

MOE_FIXTURES = ("qwen3-moe-tiny", "glm4-moe-tiny", "glm4-moe-tiny-plain")

# The code under test jitted: run op by op, each op would compile a small XLA program of its own.
_softmax_topk_router = jax.jit(softmax_topk_router, static_argnums=(1, 2))
_grouped_sigmoid_router = jax.jit(grouped_sigmoid_router, static_argnums=(2, 3, 4, 5, 6))
_routed_experts = jax.jit(routed_experts, static_argnames="backend")


# --- numpy references ----------------------------------------------------------------------

def _topk_np(values, k):
    """Top k per row, ties to the lower index (what lax.top_k does)."""
    ids = np.stack([sorted(range(len(r)), key=lambda j: (-r[j], j))[:k] for r in values])
    return np.take_along_axis(values, ids, axis=1), ids


def softmax_topk_np(logits, k, normalize):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    w, ids = _topk_np(p, k)
    return (w / w.sum(-1, keepdims=True) if normalize else w), ids


def grouped_sigmoid_np(logits, bias, k, n_group, topk_group, normalize, scale):
    t, e = logits.shape
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + bias
    if n_group > 1:
        per = choice.reshape(t, n_group, e // n_group)
        group_score = np.sort(per, axis=-1)[..., ::-1][..., :2].sum(-1)
        _, keep = _topk_np(group_score, topk_group)
        mask = np.zeros((t, n_group), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        choice = np.where(np.repeat(mask, e // n_group, axis=1), choice, -np.inf)
    _, ids = _topk_np(choice, k)
    w = np.take_along_axis(scores, ids, axis=1)
    if normalize:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * scale, ids


def experts_np(x, w, ids, gate_up, down):
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = x[t] @ gate_up[e]
            g, u = np.split(h, 2)
            out[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


# --- routing -------------------------------------------------------------------------------

ROUTING_CASES = {
    "random": np.random.default_rng(0).standard_normal((6, 8)),
    "ties": np.array([[1.0, 1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 1.0]] * 2 + [[0.0] * 8]),
    "one_expert_for_all": np.tile(np.array([0, 0, 9.0, 0, 0, 0, 0, 0]), (5, 1)),
}


@pytest.mark.parametrize("case", ROUTING_CASES)
@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_router_matches_numpy(case, normalize):
    logits = ROUTING_CASES[case].astype(np.float32)
    w, ids = _softmax_topk_router(jnp.asarray(logits), 3, normalize)
    w_np, ids_np = softmax_topk_np(logits.astype(np.float64), 3, normalize)
    np.testing.assert_array_equal(np.asarray(ids), ids_np)
    np.testing.assert_allclose(np.asarray(w), w_np, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ROUTING_CASES)
@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (2, 1), (4, 2)])
def test_grouped_sigmoid_router_matches_numpy(case, n_group, topk_group):
    logits = ROUTING_CASES[case].astype(np.float32)
    bias = np.linspace(-0.05, 0.05, 8).astype(np.float32) if case == "random" else np.zeros(8, np.float32)
    w, ids = _grouped_sigmoid_router(jnp.asarray(logits), jnp.asarray(bias), 2, n_group, topk_group, True, 2.5)
    w_np, ids_np = grouped_sigmoid_np(logits.astype(np.float64), bias, 2, n_group, topk_group, True, 2.5)
    np.testing.assert_array_equal(np.asarray(ids), ids_np)
    np.testing.assert_allclose(np.asarray(w), w_np, rtol=1e-6, atol=1e-7)


# --- expert computation --------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["ragged_dot", "dense", "pallas"])
@pytest.mark.parametrize("case", ["random", "zero_tokens_for_some", "all_to_one_expert"])
def test_routed_experts_match_numpy(backend, case):
    rng = np.random.default_rng(1)
    t, h, i, e, k = 7, 16, 8, 6, 2
    x = rng.standard_normal((t, h)).astype(np.float32)
    gate_up = rng.standard_normal((e, h, 2 * i)).astype(np.float32) * 0.3
    down = rng.standard_normal((e, i, h)).astype(np.float32) * 0.3
    if case == "random":
        ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    elif case == "zero_tokens_for_some":  # experts 0, 2, 5 get nothing
        ids = np.stack([rng.permutation([1, 3, 4])[:k] for _ in range(t)])
    else:  # every token's both slots on expert 4 (duplicate ids are still summed)
        ids = np.full((t, k), 4)
    w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    out = _routed_experts(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids, jnp.int32), jnp.asarray(gate_up),
                          jnp.asarray(down), backend=backend)
    np.testing.assert_allclose(np.asarray(out), experts_np(x, w, ids, gate_up, down), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["random", "zero_tokens_for_some"])
def test_routed_experts_mgpu_matches_ragged_dot(case):
    """The Mosaic GPU grouped GEMM (its interpreter on the CPU; bf16 only) gives ragged_dot's
    routed-expert outputs to bf16 rounding: both round each GEMM's f32 sums to bf16 once."""
    rng = np.random.default_rng(2)
    t, h, i, e, k = 12, 128, 64, 6, 2
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    gate_up = jnp.asarray(0.1 * rng.standard_normal((e, h, 2 * i)), jnp.bfloat16)
    down = jnp.asarray(0.1 * rng.standard_normal((e, i, h)), jnp.bfloat16)
    experts = range(e) if case == "random" else [1, 3, 4]  # else experts 0, 2, 5 get nothing
    ids = jnp.asarray(np.stack([rng.permutation(list(experts))[:k] for _ in range(t)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    out, ref = (np.asarray(_routed_experts(x, w, ids, gate_up, down, backend=b), np.float32)
                for b in ("mgpu", "ragged_dot"))
    np.testing.assert_allclose(out, ref, rtol=2**-6, atol=2**-6 * np.abs(ref).max())


def test_backend_switch_does_not_change_logits(monkeypatch):
    """The model state's moe_backend (an engine sets KernelConfig.moe_backend there) picks the
    expert backend; all give the same logits, and a bad name fails."""
    expected = load_expected("glm4-moe-tiny")
    for backend in ("dense", "pallas"):
        monkeypatch.setattr(Qwen3MoeModelState, "moe_backend", backend)
        assert max_logit_error(FIXTURES / "glm4-moe-tiny", expected) <= 1e-4
    monkeypatch.setattr(Qwen3MoeModelState, "moe_backend", "bogus")
    with pytest.raises(ValueError, match="MoE backend"):
        max_logit_error(FIXTURES / "glm4-moe-tiny", expected)


# --- layout, MTP, paged path, save/load ----------------------------------------------------

def test_layer_groups_stack_dense_and_moe_layers_separately():
    spec, lm, _ = load_model(FIXTURES / "qwen3-moe-tiny", dtype="float32")
    groups = spec.layer_groups()
    assert groups["dense_layers"].layers == (1,) and groups["moe_layers"].layers == (0, 2)
    assert lm.moe_layers.experts_gate_up[...].shape == (2, 8, 32, 32)  # [layers, E, H, 2I]
    assert not spec.has_mtp
    spec, lm, _ = load_model(FIXTURES / "glm4-moe-tiny", dtype="float32")
    assert spec.layer_groups()["dense_layers"].layers == (0,)
    assert lm.moe_layers.router_bias[...].dtype == jnp.float32
    assert spec.has_mtp and lm.mtp.eh_proj[...].shape == (1, 32, 64)  # [layers, out, in]


def test_mtp_layer_matches_hugging_face():
    expected = load_expected("glm4-moe-tiny")
    _, lm, _ = load_model(FIXTURES / "glm4-moe-tiny", dtype="float32")
    graphdef, weights = nnx.split(lm)

    @jax.jit
    def mtp(weights, ids, prev_hidden, pos):
        model = nnx.merge(graphdef, weights)
        hidden, _ = model.forward_mtp(0, ids, prev_hidden, pos, DenseAttention(jnp.zeros_like(pos), pos))
        return hidden, model.compute_logits(hidden)

    ids = jnp.asarray(expected["mtp_input_ids"])
    with jax.default_matmul_precision("highest"):
        hidden, logits = mtp(weights, ids, jnp.asarray(expected["mtp_prev_hidden"]),
                             jnp.arange(ids.shape[0], dtype=jnp.int32))
    assert np.abs(np.asarray(hidden) - expected["mtp_hidden"]).max() <= 1e-4
    assert np.abs(np.asarray(logits) - expected["mtp_logits"]).max() <= 1e-4


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_chunked_paged_prefill_with_padding_matches_dense(name):
    """Padding tokens are routed too; they must not change the real tokens' outputs."""
    spec, lm, _ = load_model(FIXTURES / name, dtype="float32")
    prompt = np.random.default_rng(1).integers(0, spec.vocab_size, 13).astype(np.int32)
    block, num_blocks = 4, 8
    kv = allocate_kv_cache(spec, num_blocks=num_blocks, block_size=block, dtype=jnp.float32)
    table = np.zeros((1, 8), np.int32)
    table[0, :4] = [5, 2, 7, 0]
    logits = []
    for start in range(0, len(prompt), 5):
        ids = prompt[start:start + 5]
        n, pad = len(ids), 8
        pos = np.arange(start, start + n, dtype=np.int32)
        slots = np.full(pad, -1, np.int32)
        slots[:n] = table[0, pos // block] * block + pos % block
        chunk_logits, kv = paged_chunk_logits(lm, kv, np.pad(ids, (0, pad - n)), np.pad(pos, (0, pad - n)),
                                              (slots, table, [start + n], [0, n], 1), use_kernels=False)
        logits.append(np.asarray(chunk_logits[:n]))
    dense = dense_logits(lm, prompt, np.arange(len(prompt)), np.zeros(len(prompt)))
    assert np.abs(np.concatenate(logits) - np.asarray(dense)).max() <= 1e-4


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_save_hf_checkpoint_round_trip(name, tmp_path):
    _, lm, _ = load_model(FIXTURES / name, dtype="float32")
    out = save_hf_checkpoint(lm, tmp_path / name, dtype=jnp.float32)
    assert max_logit_error(out, load_expected(name)) <= 1e-4


@pytest.mark.parametrize("preset,params,gib", [("qwen3-30b-a3b", 30.53e9, 56.9),
                                               ("glm-4.5-air-fp8", 106.9e9 + 2.4e9, 103.0)])
def test_moe_presets_build_abstractly_with_published_sizes(preset, params, gib):
    """Qwen3-30B-A3B: 30.5B parameters in bf16. GLM-4.5-Air: 106B (+ its MTP layer) in FP8
    (~110 GB, fits one H200): experts, attention and shared experts FP8, the rest bf16."""
    from flax import nnx

    from mrv2_jax.models.loader import init_model, load_hf_config, resolve_model_path

    cfg = load_hf_config(resolve_model_path(preset))
    lm = nnx.eval_shape(lambda: init_model(cfg, jnp.bfloat16))
    leaves = jax.tree.leaves(nnx.state(lm, nnx.Param))
    n = sum(np.prod(x.shape) for x in leaves if not str(x.dtype) == "float32")
    size = sum(np.prod(x.shape) * x.dtype.itemsize for x in leaves) / 2**30
    assert abs(n - params) / params < 0.01, n
    assert abs(size - gib) / gib < 0.01, size
    assert len(leaves) < 60  # stacked: a handful of leaves per layer kind


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_engine_greedy_outputs_match_dense_reference_on_all_arms(name):
    """The MoE families run through the unchanged engine and runners (v1, v2-sync, v2-async)
    and give the dense reference's greedy tokens."""
    from mrv2_jax.llm import LLM
    from mrv2_jax.sampling_params import SamplingParams
    from tests.engine_reference import greedy_reference

    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 64, n)] for n in (5, 11, 3)]
    expected = [greedy_reference(FIXTURES / name, p, 6) for p in prompts]
    for runner in ("v1", "v2"):
        # One 8-token bucket: the 11-token prompt prefills in two chunks. Greedy batches only: the
        # greedy sampler variant runs them, a third of `all`'s compile on a CPU.
        llm = LLM(str(FIXTURES / name), runner=runner, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
                  max_model_len=64, num_gpu_blocks=32, block_size=4, sampler_variants="greedy,all",
                  show_progress=False)
        # v2-sync and v2-async: one engine, its loop switched (it holds no step between generate calls).
        for async_scheduling in (False, True) if runner == "v2" else (False,):
            llm.engine.async_scheduling = async_scheduling
            outs = llm.generate(prompts,
                                SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == expected, (runner, async_scheduling)
