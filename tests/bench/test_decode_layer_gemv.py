"""benchmarks.decode_layer_gemv: the four fused GEMV kernels a layer (interpreted) compute the layers that XLA
computes from the same weights ([K, N] or [N, K], one row or padded to eight), and the report says so; --ways
picks ways."""

import json

from benchmarks import decode_layer_gemv
from tests.bench.test_benchmarks import ENVIRONMENT_KEYS


def test_the_fused_layers_match_xla_s(tmp_path):
    out = tmp_path / "layers.json"
    results = decode_layer_gemv.main(["--tiny", "--output-json", str(out)])
    assert [r["way"] for r in results] == ["xla_1row", "xla_8row", "nk_1row", "nk_8row", "gemv"]
    # h after two layers (values of a few units): within a few bf16 roundings of XLA's one-row result.
    assert all(r["max_abs_error"] <= 0.1 for r in results), results
    report = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= report.keys() and report["dims"] == decode_layer_gemv.TINY




def test_ways_picks_the_ways():
    assert [r["way"] for r in decode_layer_gemv.main(["--tiny", "--ways", "nk_1row", "xla_1row"])] == [
        "nk_1row", "xla_1row"]
