"""Checkpoint loading: sharded safetensors, both rope spellings, orbax, presets, clear errors."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from mrv2_jax.models.checkpoint import convert
from mrv2_jax.models.loader import load_model, resolve_model_path
from tests.parity import FIXTURES, dense_logits, load_expected, max_logit_error


def copy_fixture(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_sharded_safetensors_with_index(tmp_path):
    src = copy_fixture("glm4-tiny", tmp_path)
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(src / fname))
        weight_map |= {n: fname for n in shard_names}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert max_logit_error(src, load_expected("glm4-tiny")) <= 1e-4


@pytest.mark.parametrize("name", ["qwen3-tiny", "glm4-tiny"])
def test_legacy_top_level_rope_theta_spelling(name, tmp_path):
    src = copy_fixture(name, tmp_path)
    config = json.loads((src / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope["partial_rotary_factor"]
    (src / "config.json").write_text(json.dumps(config))
    assert max_logit_error(src, load_expected(name)) <= 1e-4


def test_wrong_rope_theta_changes_logits(tmp_path):
    """The rope setting is really read: a different theta must move the logits."""
    src = copy_fixture("qwen3-tiny", tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 123.0
    (src / "config.json").write_text(json.dumps(config))
    assert max_logit_error(src, load_expected("qwen3-tiny")) > 1e-2


def test_orbax_round_trip_is_bit_exact(tmp_path):
    _, lm, src = load_model(FIXTURES / "qwen3-tiny", dtype="float32")
    out = convert(src, lm, tmp_path / "converted")
    assert (out / "config.json").is_file() and (out / "params").is_dir()
    _, restored, _ = load_model(out, dtype="float32")  # load_format="auto" picks orbax
    before = jax.tree.leaves(nnx.state(lm, nnx.Param))
    after = jax.tree.leaves(nnx.state(restored, nnx.Param))
    assert len(before) == len(after) > 0
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert max_logit_error(out, load_expected("qwen3-tiny")) <= 1e-4


def test_a_directory_converted_with_the_old_layout_is_refused(tmp_path):
    """A converted directory without the layout file (linear weights [in, out], before layout 2) or with
    another version is refused by name, not loaded transposed."""
    _, lm, src = load_model(FIXTURES / "qwen3-tiny", dtype="float32")
    out = convert(src, lm, tmp_path / "converted")
    layout = out / "params_layout.json"
    assert json.loads(layout.read_text()) == {"layout_version": 2}
    layout.unlink()
    with pytest.raises(ValueError, match="layout 1.*convert the model again"):
        load_model(out, dtype="float32")
    layout.write_text(json.dumps({"layout_version": 3}))
    with pytest.raises(ValueError, match="layout 3"):
        load_model(out, dtype="float32")


def test_unsupported_architecture_is_named(tmp_path):
    src = copy_fixture("qwen3-tiny", tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM2"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*Qwen3ForCausalLM2"):
        load_model(src)


def test_missing_weight_is_named(tmp_path):
    src = copy_fixture("qwen3-tiny", tmp_path)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(src)


def test_unknown_model_and_bad_options_are_clear_errors():
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="load_format"):
        load_model("qwen3-0.6b", load_format="pickle")
    with pytest.raises(ValueError, match="dtype"):
        load_model("qwen3-0.6b", dtype="int3")


def test_bf16_load_is_close_to_f32():
    expected = load_expected("glm4-tiny")
    _, lm, _ = load_model(FIXTURES / "glm4-tiny", dtype="bfloat16")
    logits = dense_logits(lm, expected["input_ids"], expected["positions"], expected["segment_ids"])
    err = np.abs(np.asarray(logits) - expected["logits"]).max()
    assert err <= 0.05 * np.abs(expected["logits"]).max()


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "glm-4-9b-0414"])
def test_presets_resolve_with_expected_shapes(preset):
    """Presets build abstractly (no memory) with the published parameter counts."""
    from mrv2_jax.models.loader import init_model, load_hf_config

    cfg = load_hf_config(resolve_model_path(preset))
    lm = nnx.eval_shape(lambda: init_model(cfg, jnp.bfloat16))
    n = sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(lm, nnx.Param)))
    published = {"qwen3-0.6b": 0.596e9, "qwen3-8b": 8.19e9, "glm-4-9b-0414": 9.4e9}[preset]
    assert abs(n - published) / published < 0.03, n


def test_dummy_load_runs_a_forward():
    """A tiny dummy config (not a preset: CPU CI) loads random weights and runs."""
    _, lm, _ = load_model(FIXTURES / "qwen3-tiny", dtype="bfloat16", load_format="dummy")
    ids = jnp.array([1, 2, 3], jnp.int32)
    logits = dense_logits(lm, ids, np.arange(3), np.zeros(3))
    assert logits.shape == (3, 96) and bool(jnp.isfinite(logits).all())
    assert float(jnp.std(logits)) > 0
