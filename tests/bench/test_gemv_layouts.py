"""benchmarks.gemv_layouts: its GEMVs over the [N, K] layout (Triton, Mosaic GPU) compute the products of
XLA's dot over [K, N] (interpreters, tiny shapes), and lower for CUDA at Qwen3-0.6B's shapes."""

import functools

import jax
import jax.numpy as jnp

from benchmarks import gemv_layouts
from tests.triton_lowering import verify_triton_lowering


def test_every_way_matches_xla_s_product():
    results = gemv_layouts.main(["--tiny", "--rows", "1", "5", "--runs", "1", "--warmup", "0", "--max-configs", "1"])
    ways = {r["way"].split()[0] for r in results}
    assert ways == {"xla_kn", "xla_nk", "tdot_nk", "tfma_nk", "mfma_nk"}
    assert all("error" not in r and r["max_abs_error"] <= 0.02 for r in results), results


def test_kernels_lower_for_cuda(monkeypatch):
    verified = verify_triton_lowering(monkeypatch)
    S = jax.ShapeDtypeStruct
    configs = gemv_layouts.CONFIGS
    for rows, fma, (bn, bk, warps, stages) in ((8, False, configs["tdot_nk"][0]), (1, True, configs["tfma_nk"][0])):
        fn = functools.partial(gemv_layouts.gemv_nk, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                               fma=fma, interpret=False)
        jax.jit(fn).trace(S((rows, 3072), jnp.bfloat16), S((28, 1024, 3072), jnp.bfloat16), S((), jnp.int32)).lower(
            lowering_platforms=("cuda",))
    assert verified == [True, True]

