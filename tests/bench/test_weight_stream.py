"""benchmarks.weight_stream: the streaming probe's kernel (interpreted) visits each CTA's tiles (its rows,
and its part of K when K is split) as numpy computes them, the report says so, and a tiling that does
not divide the weight is refused by name."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import weight_stream
from tests.bench.test_benchmarks import ENVIRONMENT_KEYS


def test_every_tiny_way_reads_its_tiles(tmp_path):
    out = tmp_path / "stream.json"
    results = weight_stream.main(["--tiny", "--output-json", str(out)])
    assert [r["way"] for r in results][0] == "xla row sums" and len(results) == 4
    assert not [r for r in results if "error" in r], results  # main checks each kernel's sums against numpy
    report = json.loads(out.read_text())
    assert ENVIRONMENT_KEYS <= report.keys() and len(report["results"]) == 4


def test_the_reference_tells_the_ctas_apart():
    """The numpy reference is not symmetric in its CTAs: a kernel that read the wrong rows or the wrong part
    of K would not match it."""
    w = jnp.asarray(np.arange(2 * 64 * 512, dtype=np.float32).reshape(2, 64, 512) % 7 - 3, jnp.bfloat16)
    whole, split = (weight_stream.stream_reference(w, 1, rows=8, ctas=4, ksplit=s)[0, ::8] for s in (1, 2))
    assert len(set(whole.tolist())) > 1 and len(set(split.tolist())) > 1
    assert np.isclose(whole.sum(), split.sum())  # the same tiles, split differently


def test_a_tiling_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="does not tile"):
        weight_stream.stream(jnp.zeros((1, 64, 512), jnp.bfloat16), 0, rows=32, stages=2, ctas=4, interpret=True)
