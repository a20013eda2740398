"""benchmarks.decode_layer_gemv: the four fused Mosaic GPU GEMVs a layer (interpreted) compute the layers
that XLA computes from the same weights ([K, N] or [N, K], one row or padded to eight), and the report says
so; benchmarks.gemv_configs: each tile config of the kernel gives the reference's result."""

import json

from benchmarks import decode_layer_gemv
from tests.bench.test_benchmarks import ENVIRONMENT_KEYS


def test_the_fused_layers_match_xla_s(tmp_path):
    out = tmp_path / "layers.json"
    results = decode_layer_gemv.main(["--tiny", "--output-json", str(out)])
    assert [r["way"] for r in results] == ["xla_1row", "xla_8row", "nk_1row", "nk_8row", "mgpu"]
    # h after two layers (values of a few units): within a few bf16 roundings of XLA's one-row result.
    assert all(r["max_abs_error"] <= 0.1 for r in results), results
    report = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= report.keys() and report["dims"] == decode_layer_gemv.TINY



def test_gemv_configs_match_the_reference(tmp_path):
    """benchmarks.gemv_configs: every config of the one-row kernel (interpreted) gives the jnp reference's
    last layer, and the report carries the environment."""
    from benchmarks import gemv_configs

    out = tmp_path / "configs.json"
    results = gemv_configs.main(["--tiny", "--output-json", str(out)])
    # qkv_proj's tiny K (512) also takes tiles of two chunks (kbox 2); gate_up's (256) cannot.
    assert {(r["projection"], r["block_n"], r["kbox"]) for r in results} == {
        ("qkv_proj", 16, 1), ("qkv_proj", 32, 1), ("qkv_proj", 16, 2), ("qkv_proj", 32, 2),
        ("gate_up_proj", 16, 1), ("gate_up_proj", 32, 1)}
    assert all(r["max_abs_error"] <= 0.05 for r in results), results
    assert ENVIRONMENT_KEYS <= json.loads(out.read_text()).keys()
