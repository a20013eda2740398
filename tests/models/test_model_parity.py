"""Logits parity with the Hugging Face PyTorch models (golden fixtures, float32)."""

import jax
import pytest

from tests.parity import FAMILY_FIXTURES, FIXTURES, load_expected, max_logit_error


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_logits_match_hugging_face(name):
    assert max_logit_error(FIXTURES / name, load_expected(name)) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_logits_match_hugging_face_on_gpu(name):
    assert jax.default_backend() == "gpu"
    assert max_logit_error(FIXTURES / name, load_expected(name)) <= 1e-4


@pytest.mark.oracle
@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_fixtures_match_live_hugging_face_model(name, tmp_path):
    """Re-run the live PyTorch model on the committed checkpoint: the fixture is not stale,
    and our logits match torch's directly."""
    torch = pytest.importorskip("torch")
    import numpy as np
    import transformers

    expected = load_expected(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32).eval()
    live = []
    for seg in np.unique(expected["segment_ids"]):
        ids = expected["input_ids"][expected["segment_ids"] == seg]
        with torch.no_grad():
            live.append(model(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy())
    live = np.concatenate(live)
    assert np.abs(live - expected["logits"]).max() <= 1e-5
    assert max_logit_error(FIXTURES / name, expected | {"logits": live}) <= 1e-4
