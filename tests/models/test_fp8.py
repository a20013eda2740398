"""FP8 block-scaled checkpoints: a tiny checkpoint quantised by scripts/quantize_fp8.py loads
as FP8 weights + scales (no wide copy) and matches its dequantised reference."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.models.loader import load_model, save_hf_checkpoint
from mrv2_jax.models.qwen3_moe import Qwen3MoeModelState
from tests.parity import FIXTURES, dense_logits, load_expected

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "quantize_fp8.py"
_spec = importlib.util.spec_from_file_location("quantize_fp8", _SCRIPT)
quantize_fp8 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quantize_fp8)

BLOCK = 16  # the tiny models' widths are multiples of 16 (real checkpoints: 128)


def _logits(model_dir, expected):
    _, lm, _ = load_model(model_dir, dtype="float32")
    with jax.default_matmul_precision("highest"):
        return np.asarray(dense_logits(lm, expected["input_ids"], expected["positions"], expected["segment_ids"])), lm


@pytest.fixture(scope="module", params=["qwen3-moe-tiny", "glm4-moe-tiny"])
def quantised(request, tmp_path_factory):
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    quantize_fp8.quantize_checkpoint(FIXTURES / name, tmp / "fp8", BLOCK, tmp / "deq")
    return name, tmp


def test_block_quantisation_round_trip_error_is_fp8_sized():
    w = np.random.default_rng(0).standard_normal((40, 72)).astype(np.float32)
    q, s = quantize_fp8.quantize_blocks(w, 16)
    assert q.dtype == np.dtype("float8_e4m3fn") and s.shape == (3, 5)
    err = np.abs(quantize_fp8.dequantize(q, s, 16) - w)
    assert err.max() <= 2**-4 * np.abs(w).max()  # e4m3: 3 mantissa bits


def test_fp8_weights_load_as_fp8_with_scales(quantised):
    name, tmp = quantised
    spec, lm, _ = load_model(tmp / "fp8", dtype="float32")
    assert spec.fp8_block == BLOCK
    moe = lm.moe_layers
    assert moe.experts_gate_up[...].dtype == jnp.float8_e4m3fn
    assert moe.experts_gate_up_scale[...].shape == (*moe.experts_gate_up[...].shape[:2], 32 // BLOCK, 32 // BLOCK)
    assert moe.qkv_proj[...].dtype == jnp.float8_e4m3fn
    assert moe.router[...].dtype == jnp.float32  # the router stays wide


@pytest.mark.parametrize("backend", ["ragged_dot", "pallas"])
def test_fp8_model_matches_dequantised_reference(quantised, backend, monkeypatch):
    monkeypatch.setattr(Qwen3MoeModelState, "moe_backend", backend)
    name, tmp = quantised
    expected = load_expected(name)
    fp8_logits, _ = _logits(tmp / "fp8", expected)
    ref_logits, _ = _logits(tmp / "deq", expected)
    assert np.abs(fp8_logits - ref_logits).max() <= 1e-4
    # A sanity check against the original f32 model: FP8 rounding (up to 6%/weight) through
    # 3-4 random layers (weights of std 0.2, no training to damp it) and the odd flipped choice
    # of a near-tied expert give 0.12 (Qwen3-MoE) and 0.28 (GLM) relative error here; the
    # exact check is the one above, and test_block_quantisation_... bounds each weight.
    rel = np.linalg.norm(fp8_logits - expected["logits"]) / np.linalg.norm(expected["logits"])
    assert rel <= 0.35


def test_fp8_checkpoint_saves_and_reloads(quantised, tmp_path):
    name, tmp = quantised
    _, lm, _ = load_model(tmp / "fp8", dtype="float32")
    out = save_hf_checkpoint(lm, tmp_path / "resaved", dtype=jnp.float32)
    expected = load_expected(name)
    a, _ = _logits(tmp / "fp8", expected)
    b, _ = _logits(out, expected)
    np.testing.assert_array_equal(a, b)


def test_dummy_fp8_init_for_a_quantised_config(quantised):
    name, tmp = quantised
    spec, lm, _ = load_model(tmp / "fp8", dtype="bfloat16", load_format="dummy")
    assert lm.moe_layers.experts_down[...].dtype == jnp.float8_e4m3fn
    ids = jnp.arange(8, dtype=jnp.int32) % spec.vocab_size
    logits = dense_logits(lm, ids, np.arange(8), np.zeros(8))
    assert bool(jnp.isfinite(logits).all())
