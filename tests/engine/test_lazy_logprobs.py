"""Sample logprobs kept as row references and built into dicts when read (engine/lazy_logprobs.py,
runner/token_logprobs.py), against dicts built here straight from the raw arrays."""

import copy
import dataclasses
import pickle

import numpy as np
import pytest

from mrv2_jax.engine.lazy_logprobs import LazyLogprobs, LogprobStore, logprob_dict
from mrv2_jax.engine.output import Logprob
from mrv2_jax.engine.output_processor import OutputProcessor
from mrv2_jax.engine.request import Request
from mrv2_jax.engine.scheduler_output import EngineCoreOutput
from mrv2_jax.entrypoints import openai_responses as R
from mrv2_jax.runner.token_logprobs import LogprobBlock, LogprobRow, TokenLogprobs
from mrv2_jax.runner.v2 import PendingStep
from mrv2_jax.sample.sampler import SamplerOutput
from mrv2_jax.sampling_params import SamplingParams

WIDTH = 6  # the step's columns: the sampled token + up to 5 top logprobs


def decode(token_id):
    return f"<{token_id}>"


def word_tokenizer(vocab: int = 64):
    """A real (Rust) tokenizer whose token i reads as decode(i)."""
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({decode(i): i for i in range(vocab)}, unk_token=decode(0)))


def random_block(rng, num_rows, vocab=50):
    """Host arrays like a step's: top columns with distinct ids in descending logprob order;
    some rows' sampled token is also one of their top tokens."""
    ids = np.stack([rng.choice(vocab, WIDTH, replace=False) for _ in range(num_rows)]).astype(np.int32)
    values = np.sort(-rng.random((num_rows, WIDTH)) * 5, axis=1)[:, ::-1].astype(np.float32)
    ranks = rng.integers(1, 40, num_rows).astype(np.int32)
    top_sampled = rng.random(num_rows) < 0.5  # sampled = top token j: same id, value and rank j
    for r in np.flatnonzero(top_sampled):
        j = int(rng.integers(1, WIDTH))
        ids[r, 0], values[r, 0], ranks[r] = ids[r, j], values[r, j], j
    return values, ids, ranks


def reference_dict(values, ids, ranks, row, n):
    """The dict as the engine has always made it, built here from the raw arrays."""
    out = {int(ids[row, 0]): Logprob(float(values[row, 0]), int(ranks[row]), decode(int(ids[row, 0])))}
    for j in range(1, 1 + n):
        out.setdefault(int(ids[row, j]), Logprob(float(values[row, j]), j, decode(int(ids[row, j]))))
    return out


def rows_of(rng, num_tokens, n=3):
    """`num_tokens` rows, each of a step of its own, and their reference dicts."""
    rows, want = [], []
    for _ in range(num_tokens):
        values, ids, ranks = random_block(rng, 4)
        row = int(rng.integers(4))
        rows.append(LogprobRow(LogprobBlock(values, ids, ranks), row, n))
        want.append(reference_dict(values, ids, ranks, row, n))
    return rows, want


def store_of(rng, num_tokens, rows_kept=1024):
    rows, want = rows_of(rng, num_tokens)
    store = LogprobStore(decode, rows_kept)
    for row in rows:  # one token per step, as the output processor appends them
        store.extend([row])
    return store, want


def test_rows_build_the_reference_dicts_sampled_token_first():
    rng = np.random.default_rng(0)
    store, want = store_of(rng, 20)
    got = store.snapshot()
    assert got == want and list(got) == want
    for entry, ref in zip(got, want):
        assert list(entry) == list(ref)  # key order: the sampled token first
    assert any(len(ref) == 3 + 1 for ref in want) and any(len(ref) == 3 for ref in want)


def test_behaves_like_a_list_of_dicts():
    rng = np.random.default_rng(1)
    store, want = store_of(rng, 7)
    got = store.snapshot()
    assert isinstance(got, LazyLogprobs) and len(got) == 7 and got
    assert got[0] == want[0] and got[-1] == want[-1] and got[-7] == want[0]
    with pytest.raises(IndexError):
        got[7]
    with pytest.raises(IndexError):
        got[-8]
    for s in (slice(2, 5), slice(None, 3), slice(4, None), slice(-3, -1), slice(5, 2), slice(3, 99), slice(None)):
        assert got[s] == want[s] and len(got[s]) == len(want[s])
    assert got[1:6][1:3] == want[1:6][1:3] and got[1:6][-1] == want[5]
    assert got[::2] == want[::2] and got[::-1] == want[::-1]
    assert [e for e in got] == want and list(reversed(got)) == want[::-1]
    assert got.index(want[3]) == 3 and want[2] in got and got.count(want[4]) == 1
    assert got == got[:] and got != want[:-1] and got != want[::-1] and want == got and got != "abc"
    assert got != tuple(want) and [want[0]] == got[:1]
    assert repr(got) == f"LazyLogprobs({want!r})"
    assert not LogprobStore(decode).snapshot() and LogprobStore(decode).snapshot() == []
    assert pickle.loads(pickle.dumps(got)) == want and type(copy.deepcopy(got)) is list


def test_snapshots_do_not_change_when_tokens_arrive():
    rng = np.random.default_rng(2)
    store, want = store_of(rng, 3)
    early, tail = store.snapshot(), store.snapshot()[1:]
    more, more_want = rows_of(rng, 5)
    store.extend(more)
    assert len(early) == 3 and early == want and tail == want[1:] and early[3:] == []
    with pytest.raises(IndexError):
        early[3]
    assert store.snapshot() == want + more_want
    assert early[0] is store.snapshot()[0]  # built once, shared by every view


def test_old_rows_are_detached_from_their_step_arrays():
    rng = np.random.default_rng(3)
    store, want = store_of(rng, 6, rows_kept=2)
    kinds = [type(e) for e in store._entries]
    assert kinds == [TokenLogprobs] * 4 + [LogprobRow] * 2
    assert store.snapshot() == want


def _fake_step(tokens, values, ids, ranks):
    class Host(np.ndarray):  # a host array that answers PendingStep's async copy
        def copy_to_host_async(self):
            pass

    host = lambda a: np.asarray(a).view(Host)  # noqa: E731
    return SamplerOutput(host(tokens), host(values), host(ids), host(ranks))


def test_pending_step_rows_of_a_fused_call():
    """[K, R] tokens (-1 once a row stopped): row r's token k is row k * R + r of the flat block."""
    rng = np.random.default_rng(4)
    K, num_rows = 3, 4
    values, ids, ranks = random_block(rng, K * num_rows)
    tokens = np.array([[1, 2, 3, 4], [5, -1, 7, 8], [9, -1, -1, 10]], np.int32)
    out = _fake_step(tokens, values.reshape(K, num_rows, WIDTH), ids.reshape(K, num_rows, WIDTH),
                     ranks.reshape(K, num_rows))
    req_ids = ["a", "b", "c", "d"]
    step = PendingStep(out, req_ids, set(req_ids), {"a": 5, "b": 2, "c": 0})
    got = step.logprobs()
    assert sorted(got) == ["a", "b", "c"] and [len(got[r]) for r in "abc"] == [3, 1, 2]
    for i, r in enumerate("abc"):
        for k, entry in enumerate(got[r]):
            n = {"a": 5, "b": 2, "c": 0}[r]
            assert logprob_dict(entry, decode) == reference_dict(values, ids, ranks, k * num_rows + i, n)


def test_output_processor_streams_lazy_snapshots():
    rng = np.random.default_rng(5)
    proc = OutputProcessor(word_tokenizer())
    proc.add(Request("r", [1, 2], SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True)))
    proc.add(Request("plain", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True)))
    outputs, want = [], []
    for step in range(4):
        values, ids, ranks = random_block(rng, 2)
        block = LogprobBlock(values, ids, ranks)
        changed, _ = proc.process([EngineCoreOutput("r", [int(ids[1, 0])], "length" if step == 3 else None,
                                                    new_logprobs=[LogprobRow(block, 1, 2)]),
                                   EngineCoreOutput("plain", [int(ids[0, 0])])])
        outputs.append(changed[0])
        assert changed[1].outputs[0].logprobs is None
        want.append(reference_dict(values, ids, ranks, 1, 2))
    assert [out.outputs[0].logprobs == want[: i + 1] for i, out in enumerate(outputs)] == [True] * 4
    # The OpenAI server formats a stream of them as it formatted lists.
    fmt, lazy_deltas, list_deltas = R.LogprobFormatter(None, top_k=2), R.DeltaTracker(), R.DeltaTracker()
    for out in outputs:
        c = out.outputs[0]
        as_list = dataclasses.replace(out, outputs=[dataclasses.replace(c, logprobs=list(c.logprobs))])
        assert R.chat_logprobs(fmt, out, lazy_deltas) == R.chat_logprobs(fmt, as_list, list_deltas)
    assert lazy_deltas == list_deltas and lazy_deltas.num_tokens == 4


def test_host_benchmark_runs():
    from benchmarks.host_logprobs import run_case

    for final_only in (False, True):
        r = run_case(None, num_rows=4, num_logprobs=3, steps=3, final_only=final_only, vocab=100)
        assert r["runner_us"] > 0 and r["process_us"] > 0
