"""Helpers for comparing our models' logits with Hugging Face golden fixtures."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mrv2_jax import envs
from mrv2_jax.models.attention import PagedAttention
from mrv2_jax.models.loader import load_hf_config, load_model
from mrv2_jax.models.model_state import model_state_for

FIXTURES = Path(__file__).parent / "fixtures"
FAMILY_FIXTURES = ("qwen3-tiny", "qwen3-tiny-tied", "glm4-tiny", "qwen3-moe-tiny", "glm4-moe-tiny",
                   "glm4-moe-tiny-plain")


# The tests' forward passes run as jitted programs, the weights an argument: on XLA:CPU one compile is a
# few times cheaper than running a forward op by op (a small program per op).

def dense_logits(lm, ids, positions, segment_ids) -> jax.Array:
    """`lm.forward_dense(ids, positions, segment_ids)`, jitted."""
    graphdef, weights = nnx.split(lm)
    return _dense_forward(graphdef)(weights, *(jnp.asarray(a, jnp.int32) for a in (ids, positions, segment_ids)))


@functools.cache
def _dense_forward(graphdef):
    return jax.jit(lambda weights, *args: nnx.merge(graphdef, weights).forward_dense(*args))


def paged_chunk_logits(lm, kv, ids, positions, attention_arrays, **attention_options):
    """One chunk of tokens through `lm` on the paged KV cache, jitted: `attention_arrays` are
    PagedAttention's arrays, `attention_options` its keywords -> (logits of every token, new KV cache)."""
    graphdef, weights = nnx.split(lm)
    forward = _paged_forward(graphdef, tuple(sorted(attention_options.items())))
    return forward(weights, kv, jnp.asarray(ids, jnp.int32), jnp.asarray(positions, jnp.int32),
                   *(jnp.asarray(a, jnp.int32) for a in attention_arrays))


@functools.cache
def _paged_forward(graphdef, attention_options: tuple):
    def forward(weights, kv, ids, positions, *attention_arrays):
        model = nnx.merge(graphdef, weights)
        hidden, kv = model(ids, positions, PagedAttention(*attention_arrays, **dict(attention_options)), kv)
        return model.compute_logits(hidden), kv

    return jax.jit(forward)


def max_logit_error(model_dir, expected: dict, **load_kwargs) -> float:
    """Largest |our logits - expected logits| for the fixture's flattened ragged batch."""
    _, lm, _ = load_model(model_dir, dtype="float32", **load_kwargs)
    with jax.default_matmul_precision("highest"):  # no TF32 on GPUs
        logits = dense_logits(lm, expected["input_ids"], expected["positions"], expected["segment_ids"])
    return float(np.abs(np.asarray(logits) - expected["logits"]).max())


def load_expected(name: str) -> dict:
    return dict(np.load(FIXTURES / name / "expected.npz"))


def fixture_model_state(fixture: str, **config):
    """The ModelState of a fixture model's config, with `config` fields changed."""
    hf_config = load_hf_config(FIXTURES / fixture)
    for key, value in config.items():
        setattr(hf_config, key, value)
    return model_state_for(hf_config)


def run_on_virtual_devices(module: str, devices: int = 4) -> dict:
    """Run `python -m module` with `devices` virtual CPU devices (the rest of the suite keeps one)
    and return the JSON its last output line holds."""
    flags = f"{envs.subprocess_env().get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    run = subprocess.run([sys.executable, "-m", module], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=600, env=envs.subprocess_env(XLA_FLAGS=flags))
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@functools.cache
def parallel_child() -> dict:
    """The tensor-, pipeline- and expert-parallel runs (tests/runner/parallel_run.py), made once per
    process for the three modules that check them (one xdist unit: tests/conftest.py)."""
    return run_on_virtual_devices("tests.runner.parallel_run")
