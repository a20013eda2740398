"""benchmarks.projection_forms: every form of the product, the kernels interpreted, matches numpy at 1, 8
and 32 rows (main checks each before timing), the report says which forms ran, and --forms picks them."""

import json

from benchmarks import projection_forms
from tests.bench.test_benchmarks import ENVIRONMENT_KEYS


def test_every_tiny_form_matches_numpy_and_is_reported(tmp_path):
    out = tmp_path / "forms.json"
    results = projection_forms.main(["--tiny", "--output-json", str(out)])
    forms = {rows: [r["form"] for r in results if r["rows"] == rows] for rows in (1, 8, 32)}
    assert forms[8] == forms[32] == ["dot", "reduce [R, N]", "reduce [N, R]", "triton 8x256 w4",
                                     projection_forms.ENGINE]
    assert forms[1] == forms[8] + [projection_forms.STATIC_LAYER]
    picked = projection_forms.main(["--tiny", "--rows", "8", "--forms", "reduce", "w4"])
    assert [r["form"] for r in picked] == ["reduce [R, N]", "reduce [N, R]", "triton 8x256 w4"]
    assert not [r for r in results if "error" in r], results
    report = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= report.keys() and len(report["results"]) == len(results)
