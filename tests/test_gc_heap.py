"""Python's garbage collector around the engine (mrv2_jax/gc_heap.py): generation 0 relaxed while an
engine runs, so that steady decode steps trigger no collection, and the caller's thresholds back after."""

import contextlib
import gc
import threading

import pytest

from benchmarks.host_step import build
from mrv2_jax.engine.request import Request
from mrv2_jax.gc_heap import ENGINE_GEN0_THRESHOLD, relaxed_collection
from mrv2_jax.llm import LLM
from mrv2_jax.sampling_params import SamplingParams
from tests.engine_reference import greedy_reference
from tests.parity import FIXTURES


@pytest.fixture
def default_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults
    yield
    gc.set_threshold(*saved)


def test_relaxed_collection_raises_generation_0_only_and_restores(default_thresholds):
    with relaxed_collection():
        assert gc.get_threshold() == (ENGINE_GEN0_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(KeyError), relaxed_collection():
        raise KeyError("a failing run")
    assert gc.get_threshold() == (700, 10, 10)
    gc.set_threshold(10 * ENGINE_GEN0_THRESHOLD, 5, 5)  # a caller's own, higher threshold stays
    with relaxed_collection():
        assert gc.get_threshold() == (10 * ENGINE_GEN0_THRESHOLD, 5, 5)
    gc.set_threshold(0, 10, 10)  # automatic collection turned off by the caller stays off
    with relaxed_collection():
        assert gc.get_threshold() == (0, 10, 10)


def test_overlapping_blocks_in_two_threads_restore_only_after_the_last(default_thresholds):
    """The thresholds are the process's: a block that ends while another thread's still runs leaves
    them relaxed, and the last one to end restores the caller's (not the first block's view)."""
    entered, release = threading.Event(), threading.Event()

    def engine_thread():
        with relaxed_collection():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    assert entered.wait(10)
    with relaxed_collection():
        assert gc.get_threshold()[0] == ENGINE_GEN0_THRESHOLD
    assert gc.get_threshold()[0] == ENGINE_GEN0_THRESHOLD  # the other thread's block still runs
    release.set()
    thread.join(10)
    assert gc.get_threshold() == (700, 10, 10)


def _collections_in_steady_decode(rows: int, relaxed: bool) -> int:
    """Collections while the real scheduler and engine core (a stand-in runner) decode `rows` rows."""
    engine = build(rows, prompt_len=16, max_tokens=40, streaming=False)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(rows):
        engine.add_request(Request(f"r{i}", [3 + i % 50] * 16, params))
    for _ in range(4):  # admission and prefill
        engine.step()
    counted = []
    callback = lambda phase, info: phase == "start" and counted.append(info["generation"])  # noqa: E731
    gc.collect()
    # Counted inside the block only: the caller's thresholds, once restored, may collect at once.
    with relaxed_collection() if relaxed else contextlib.nullcontext():
        gc.callbacks.append(callback)
        try:
            for _ in range(30):
                engine.step()
        finally:
            gc.callbacks.remove(callback)
    return len(counted)


def test_steady_decode_of_512_rows_triggers_no_collection_when_relaxed(default_thresholds):
    assert _collections_in_steady_decode(512, relaxed=False) >= 20  # about one a step at CPython's 700
    assert _collections_in_steady_decode(512, relaxed=True) == 0


def test_generate_runs_relaxed_and_gives_the_thresholds_back(default_thresholds):
    model = FIXTURES / "qwen3-tiny"
    llm = LLM(str(model), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              num_gpu_blocks=64, block_size=4, show_progress=False)
    seen, step = [], llm.engine.step
    llm.engine.step = lambda: seen.append(gc.get_threshold()) or step()
    prompts = [[5, 9, 11], [7, 3, 8, 21]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [greedy_reference(model, p, 5) for p in prompts]
    assert seen and all(t == (ENGINE_GEN0_THRESHOLD, 10, 10) for t in seen)
    assert gc.get_threshold() == (700, 10, 10)
