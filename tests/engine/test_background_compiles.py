"""The engine process's constraint compiles beside its loop: a request waits only for its own
compile, failures come back per request, an abort drops a request still compiling."""

import time
from types import SimpleNamespace

from mrv2_jax.engine.background_compiles import BackgroundCompiles
from mrv2_jax.engine.tokenizer import load_tokenizer
from mrv2_jax.models.loader import CHECKPOINTS_DIR
from mrv2_jax.sampling_params import SamplingParams
from mrv2_jax.structured.compiler import ConstraintCompiler


def cmd(request_id, **structured):
    return SimpleNamespace(request_id=request_id, params=SamplingParams(structured_outputs=structured or None))


def test_compiles_finish_in_order_with_their_errors():
    compiles = BackgroundCompiles(ConstraintCompiler(load_tokenizer(CHECKPOINTS_DIR / "demo-qwen3"), (0,), 2048))
    plain = cmd("plain")
    assert not compiles.needs_compile(plain.params)
    good, bad, gone = cmd("good", regex="[a-z]{1,5}z"), cmd("bad", regex=r"(a)\1"), cmd("gone", regex="[0-9]{3}q")
    for c in (good, bad, gone):
        assert compiles.needs_compile(c.params)
        compiles.submit(c)
    compiles.abort(["gone"])
    finished, deadline = [], time.monotonic() + 30
    while compiles and time.monotonic() < deadline:
        finished += compiles.done()
        time.sleep(0.01)
    assert [c.request_id for c, _ in finished] == ["good", "bad"]
    assert finished[0][1] is None and "structured_outputs.regex" in str(finished[1][1])
    assert not compiles.needs_compile(good.params)  # cached now: added at once next time


def test_no_tokenizer_no_background_compile():
    assert not BackgroundCompiles(None).needs_compile(cmd("x", regex="a").params)
