"""The config cache: a model state built from a cached config equals the one built from
transformers' own config, for every shipped config (each family); a warm read imports no
transformers; an edited config.json is read afresh."""

import json
import shutil
import subprocess
import sys

import pytest

from mrv2_jax.models.config_cache import CachedConfig, load_hf_config_cached
from mrv2_jax.models.loader import load_hf_config
from mrv2_jax.models.model_state import model_state_for
from mrv2_jax.models.paths import CHECKPOINTS_DIR

CONFIGS = sorted(p.parent for p in CHECKPOINTS_DIR.glob("**/config.json"))


def _described(state) -> dict:
    """Everything a model state derives from its config: its attributes and its layer groups."""
    attrs = {k: v for k, v in vars(state).items() if k != "hf_config"}
    groups = {name: (g.layers, g.shapes, g.sources) for name, g in state.layer_groups().items()}
    mtp = state.mtp_group()
    return {"attrs": attrs, "groups": groups, "mtp": mtp and (mtp.layers, mtp.shapes, mtp.sources)}


@pytest.mark.parametrize("model_dir", CONFIGS, ids=lambda p: p.name)
def test_a_cached_config_builds_the_same_model_state(model_dir, tmp_path):
    fresh = load_hf_config_cached(model_dir, tmp_path, load_hf_config)  # read by transformers, then kept
    cached = load_hf_config_cached(model_dir, tmp_path, load_hf_config)
    assert not isinstance(fresh, CachedConfig) and isinstance(cached, CachedConfig)
    assert _described(model_state_for(cached)) == _described(model_state_for(load_hf_config(model_dir)))
    for alias, canonical in type(fresh).attribute_map.items():  # the family's aliases read through
        if hasattr(fresh, canonical):
            assert getattr(cached, alias) == getattr(fresh, canonical)
    with pytest.raises(AttributeError, match="no_such_field"):
        cached.no_such_field  # noqa: B018


def test_an_edited_config_is_read_afresh_and_no_cache_means_transformers(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(CHECKPOINTS_DIR / "demo-qwen3", model, ignore=shutil.ignore_patterns("*.safetensors", "params"))
    cache = tmp_path / "cache"
    load_hf_config_cached(model, cache, load_hf_config)
    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (model / "config.json").write_text(json.dumps(config))
    assert load_hf_config_cached(model, cache, load_hf_config).rms_norm_eps == 1e-3  # a new entry
    assert load_hf_config_cached(model, cache, load_hf_config).rms_norm_eps == 1e-3  # and it is kept
    assert len(list(cache.glob("*.json"))) == 2
    assert not isinstance(load_hf_config_cached(model, None, load_hf_config), CachedConfig)


def test_a_warm_read_imports_no_transformers(tmp_path):
    load_hf_config_cached(CHECKPOINTS_DIR / "demo-qwen3", tmp_path, load_hf_config)
    code = f"""
import sys
from pathlib import Path
from mrv2_jax.models.config_cache import load_hf_config_cached
def load(path):
    raise AssertionError("read with transformers")
config = load_hf_config_cached(Path({str(CHECKPOINTS_DIR / "demo-qwen3")!r}), Path({str(tmp_path)!r}), load)
print("transformers" in sys.modules, config.vocab_size)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", str(load_hf_config(CHECKPOINTS_DIR / "demo-qwen3").vocab_size)]
