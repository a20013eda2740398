"""benchmarks.stacked_weight_call: every way computes the chain a plain numpy loop computes, and the
report holds every way at every row count."""

import numpy as np

from benchmarks.stacked_weight_call import WAYS, main, make_weights, step_fn, weights_for


def numpy_chain(weights, carry, tokens):
    """The same chain in float32 numpy, layer by layer."""
    def norm(x):
        return x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-6)

    w = {k: np.asarray(v, np.float32) for k, v in weights.items()}
    h = carry + (tokens[:, None] % 7)
    for i in range(w["qkv"].shape[0]):
        q = (norm(h) @ w["qkv"][i].T)[:, :w["o"].shape[2]]
        h = h + q @ w["o"][i].T
        gate, up = np.split(norm(h) @ w["gate_up"][i].T, 2, axis=-1)
        h = norm(h + (gate / (1 + np.exp(-gate)) * up) @ w["down"][i].T)
    return h


def test_every_way_computes_the_plain_loop():
    import jax.numpy as jnp

    weights = make_weights(layers=3, hidden=64)
    rng = np.random.default_rng(0)
    carry = rng.normal(size=(5, 64)).astype(np.float32)
    tokens = np.arange(5, dtype=np.int32) * 3
    expected = numpy_chain(weights, carry, tokens)
    for way in WAYS:
        got, marker = step_fn(way)(weights_for(way, weights), jnp.asarray(carry, jnp.bfloat16), tokens)
        np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=0.08, rtol=0.05, err_msg=way)
        assert np.asarray(marker).tolist() == np.asarray(got)[:1, :1].tolist()


def test_the_report_has_every_way_at_every_row_count(tmp_path):
    report = main(["--rows", "2", "4", "--layers", "2", "--hidden", "64", "--calls", "3",
                   "--output-json", str(tmp_path / "r.json")])
    assert sorted((r["rows"], r["way"]) for r in report["results"]) == sorted(
        (rows, way) for rows in (2, 4) for way in WAYS)
    assert all(r["call_ms"] > 0 and r["busy_call_ms"] > 0 and r["pipelined_ms"] > 0 for r in report["results"])
    assert (tmp_path / "r.json").exists()
