"""The child process of tests/runner/test_expert_parallel.py: started with 4 virtual CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4), it runs the same greedy requests on Qwen3-MoE
at tensor_parallel_size 1 and, with enable_expert_parallel, 2 (and 4 where the heads allow), and
prints one JSON line: the tokens of each, and at N > 1 where the arrays live and what the compiled
steps communicate; also the experts' grouped GEMM under shard_map against one device's. On 2+ GPUs
(scripts/gpu_check.sh ep) it runs as it is, with the Pallas kernels compiled, and sizes up to the
GPU count."""

import functools
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mrv2_jax.models.moe import expert_parallel_experts, routed_experts
from mrv2_jax.models.tensor_parallel import AXIS
from tests.parity import FIXTURES
from tests.runner.tensor_parallel_run import PROMPTS, run

PROMPTS_64 = [[t % 64 for t in prompt] for prompt in PROMPTS]  # the same lengths, in the fixture's vocabulary


def wide_moe(root: Path) -> Path:
    """qwen3-moe-tiny with 8 heads and 4 KV heads (dummy weights), so that 4 devices hold one KV head
    and two of the 8 experts each; every layer a MoE layer (one layer scan), no attention bias."""
    config = json.loads((FIXTURES / "qwen3-moe-tiny" / "config.json").read_text())
    config |= {"num_attention_heads": 8, "num_key_value_heads": 4, "attention_bias": False, "mlp_only_layers": [],
               "num_hidden_layers": 2}
    path = root / "qwen3-moe-tiny-wide"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def experts_under_shard_map() -> dict:
    """One routed-experts call (bf16 tokens, 8 experts, top 2) with the experts split over 2 devices
    for the Pallas grouped GEMM (interpret mode) and over 4 for the dense backend: -> the largest
    difference from the same backend on one device, in units of the output's bf16 rounding."""
    rng = np.random.default_rng(0)
    tokens, hidden, inter, experts, top_k = 12, 32, 16, 8, 2
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    gate_up = jnp.asarray(rng.standard_normal((experts, hidden, 2 * inter)) / 4, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((experts, inter, hidden)) / 4, jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jax.nn.softmax(jnp.asarray(rng.standard_normal((tokens, top_k)), jnp.float32), axis=-1)
    out = {}
    # (The engines above ran ragged_dot, the CPU's backend, at 2 and 4 devices.)
    for backend, sizes in (("pallas", (2,)), ("dense", (4,))):
        want = np.asarray(jax.jit(functools.partial(routed_experts, backend=backend))(x, weights, ids, gate_up, down),
                          np.float32)
        ulp = np.abs(want).max() * 2.0**-8
        for n in (n for n in sizes if n <= jax.device_count()):
            mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,))
            split = NamedSharding(mesh, P(AXIS, None, None))
            w = jax.device_put(gate_up, split), jax.device_put(down, split)
            got = jax.jit(lambda x, weights, ids, gu, d, backend=backend, mesh=mesh: expert_parallel_experts(
                x, weights, ids, gu, d, mesh, backend=backend))(x, weights, ids, *w)
            out[f"{n} devices, {backend}"] = float(np.abs(np.asarray(got, np.float32) - want).max() / ulp)
    return out


def results() -> dict:
    """Every run's outputs and the experts' differences."""
    ep = dict(enable_expert_parallel=True)
    # One bucket of 8 tokens (prompts in chunks of 8): one step program per engine (and the fused one).
    engine = dict(prompts=PROMPTS_64, max_num_batched_tokens=8)
    with tempfile.TemporaryDirectory() as tmp:
        wide = wide_moe(Path(tmp))
        # The fixture (trained to the HF reference, f32; MoE, dense, MoE layers) with fused decode.
        return {"moe": {n: run(FIXTURES / "qwen3-moe-tiny", n, **engine, **(ep if n > 1 else {})) for n in (1, 2)},
                "wide": {n: run(wide, n, load_format="dummy", max_fused_steps=1, **engine, **(ep if n > 1 else {}))
                         for n in (1, 4) if n <= jax.device_count()},
                "experts": experts_under_shard_map()}


def main() -> None:
    print(json.dumps(results()), file=sys.stdout)


if __name__ == "__main__":
    main()
