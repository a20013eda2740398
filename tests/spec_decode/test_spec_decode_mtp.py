"""The `mtp` speculative method (GLM-4-MoE's multi-token-prediction layer, spec_decode/mtp_proposer.py):
the proposer's drafts against a dense reference of the same MTP computation, through a chunked
prefill and a decode step with a rejected draft; and greedy engine outputs unchanged by it, in
v2 (sync and async) and v1, over a mixed batch with chunked prefill.

The tiny GLM-4-MoE fixture has random weights, so its MTP layer rarely agrees with the target:
the engine tests check that outputs are unchanged (strict verification), the reference test
checks that the drafts are what the MTP layer predicts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.models.attention import DenseAttention
from mrv2_jax.models.loader import load_model
from mrv2_jax.spec_decode.mtp import build_mtp_proposer
from mrv2_jax.spec_decode.proposer import ProposeInputs
from tests.parity import FIXTURES

MODEL = FIXTURES / "glm4-moe-tiny"  # num_nextn_predict_layers = 1

pytestmark = pytest.mark.usefixtures("no_persistent_compile_cache")  # conftest.py says why



@functools.cache
def tiny():
    return load_model(MODEL, dtype="float32")


# --- the proposer against a dense reference --------------------------------------------------

PAD = 24  # the dense reference pads every sequence to this length: two compiles in all


@functools.cache
def _dense_fns():
    _, lm, _ = tiny()

    def setup(ids):
        pos = jnp.arange(PAD, dtype=jnp.int32)
        return pos, DenseAttention((ids < 0).astype(jnp.int32), pos)  # padding: its own segment

    @jax.jit
    def target(ids):
        pos, attention = setup(ids)
        return lm(jnp.maximum(ids, 0), pos, attention)[0]

    @jax.jit
    def mtp(ids, prev):
        pos, attention = setup(ids)
        hidden, pre_norm, _ = lm.forward_mtp(0, jnp.maximum(ids, 0), prev, pos, attention, return_pre_norm=True)
        return hidden, pre_norm

    return target, mtp


def dense(lm, ids, prev=None):
    """The target (prev None) or the MTP layer over one sequence from position 0, no cache."""
    del lm  # the jitted functions close over the fixture's model
    n = len(ids)
    padded = jnp.asarray(np.pad(np.asarray(ids, np.int32), (0, PAD - n), constant_values=-1))
    target, mtp = _dense_fns()
    if prev is None:
        return target(padded)[:n]
    hidden, pre_norm = mtp(padded, jnp.asarray(np.pad(np.asarray(prev, np.float32), ((0, PAD - n), (0, 0)))))
    return hidden[:n], pre_norm[:n]


def greedy_continuation(lm, seq, n):
    seq = list(seq)
    for _ in range(n):
        seq.append(int(jnp.argmax(lm.compute_logits(dense(lm, seq)[-1:])[0])))
    return seq


def reference_drafts(lm, seq, k, chain=None):
    """MTP drafts after the known tokens `seq`: position i reads token i + 1 and the target's
    hidden at i; later drafts chain the layer's own (pre-norm) output. -> (greedy drafts, the
    softmax at each draft position), feeding `chain`'s tokens instead of the greedy picks if given."""
    target_hidden = np.asarray(dense(lm, seq))[: len(seq) - 1]
    ids, prev, drafts, probs = list(seq[1:]), list(target_hidden), [], []
    for j in range(k):
        hidden, pre_norm = dense(lm, ids, np.stack(prev))
        logits = lm.compute_logits(hidden[-1:])[0]
        drafts.append(int(jnp.argmax(logits)))
        probs.append(np.asarray(jax.nn.softmax(logits)))
        ids.append(drafts[-1] if chain is None else int(chain[j]))
        prev.append(np.asarray(pre_norm[-1]))
    return drafts, np.stack(probs)


def step_inputs(rows, *, block_tables, t_pad, r_pad, block_size):
    """ProposeInputs of one step. rows: dicts with tokens, start (first position), hidden
    [n, H], samples, last_token, last_position, next_prompt_token."""
    ids, pos, slots, hidden, qsl, seq_lens = [], [], [], [], [0], []
    for row, table in zip(rows, block_tables):
        n = len(row["tokens"])
        p = np.arange(row["start"], row["start"] + n)
        ids += row["tokens"]
        pos += list(p)
        slots += list(np.asarray(table)[p // block_size] * block_size + p % block_size)
        hidden.append(np.asarray(row["hidden"]))
        qsl.append(qsl[-1] + n)
        seq_lens.append(row["start"] + n)
    t, r = len(ids), len(rows)
    h = hidden[0].shape[1]
    pad_t, pad_r = t_pad - t, r_pad - r
    i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))  # noqa: E731
    per_row = lambda name, fill: i32([row[name] for row in rows] + [fill] * pad_r)  # noqa: E731
    tables = np.zeros((r_pad, 8), np.int32)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    return ProposeInputs(
        input_ids=i32(ids + [0] * pad_t), positions=i32(pos + [0] * pad_t), slot_mapping=i32(slots + [-1] * pad_t),
        query_start_loc=i32(qsl + [t] * pad_r), seq_lens=i32(seq_lens + [0] * pad_r), block_tables=i32(tables),
        num_reqs=jnp.int32(r), hidden=jnp.asarray(np.concatenate(hidden + [np.zeros((pad_t, h), np.float32)])),
        samples=jnp.asarray([row["samples"] for row in rows] + [False] * pad_r),
        last_token=per_row("last_token", 0), last_position=per_row("last_position", 0),
        temperature=jnp.zeros(r_pad, jnp.float32), seeds=jnp.full(r_pad, 7, jnp.int32),
        token_rows=None, num_tokens=per_row("last_position", 0) + 1,
        next_prompt_token=per_row("next_prompt_token", -1))


def test_mtp_drafts_match_a_dense_reference():
    """Two rows over two steps. Step 1: row A prefills 8 of its 13 prompt tokens (the MTP catch-up
    needs the 9th), row B its whole 6-token prompt and samples. Step 2: A's last chunk, and B
    decodes its newest token with 2 drafts, the first accepted and the second rejected (so the
    catch-up must feed B's corrected token where the rejected draft was). After each step the
    sampling rows' 3 greedy drafts equal the dense MTP reference's, and so do the distributions
    of drafts sampled at temperature 1 (along the proposer's own sampled chain)."""
    spec, lm, _ = tiny()
    k, bs = 3, 4
    info = dict(num_blocks=16, block_size=bs, max_model_len=32, kv_dtype=jnp.float32, use_kernels=False)
    proposer = build_mtp_proposer(spec, lm, k, **info)
    sampling_proposer = build_mtp_proposer(spec, lm, k, with_probs=True, **info)
    assert proposer.num_lookahead_tokens == k - 1
    propose, propose_sampled = jax.jit(proposer.propose), jax.jit(sampling_proposer.propose)
    params, cache = proposer.init_params(), proposer.init_state()
    assert cache[0].shape[0] == 1  # one layer: the MTP layer's own cache

    def check(x, cache, seqs):
        """seqs: row -> its known tokens after the step. -> the greedy run's cache."""
        _, sampled, probs = propose_sampled(params, cache, x._replace(temperature=jnp.ones(3)))
        cache, drafts, no_probs = propose(params, cache, x)
        assert no_probs is None
        for row, seq in seqs.items():
            assert list(np.asarray(drafts[row])) == reference_drafts(lm, seq, k)[0], row
            _, expected = reference_drafts(lm, seq, k, chain=np.asarray(sampled[row]))
            np.testing.assert_allclose(np.asarray(probs[row]), expected, atol=2e-5, err_msg=str(row))
        return cache

    rng = np.random.default_rng(0)
    a, b = [int(t) for t in rng.integers(3, 64, 13)], [int(t) for t in rng.integers(3, 64, 6)]
    a_full = greedy_continuation(lm, a, 1)  # the target's token after A's prompt
    b_full = greedy_continuation(lm, b, 3)
    wrong = (b_full[8] + 1) % spec.vocab_size  # B's rejected second draft
    hidden_a = np.asarray(dense(lm, a))
    hidden_b = np.asarray(dense(lm, b_full[:8] + [wrong]))
    tables = [[3, 9, 1, 12], [5, 0, 7]]

    x = step_inputs([
        dict(tokens=a[:8], start=0, hidden=hidden_a[:8], samples=False, last_token=0, last_position=0,
             next_prompt_token=a[8]),
        dict(tokens=b, start=0, hidden=hidden_b[:6], samples=True, last_token=b_full[6], last_position=6,
             next_prompt_token=-1),
    ], block_tables=tables, t_pad=16, r_pad=3, block_size=bs)
    cache = check(x, cache, {1: b_full[:7]})

    x = step_inputs([
        dict(tokens=a[8:], start=8, hidden=hidden_a[8:], samples=True, last_token=a_full[13], last_position=13,
             next_prompt_token=-1),
        dict(tokens=[b_full[6], b_full[7], wrong], start=6, hidden=hidden_b[6:9], samples=True,
             last_token=b_full[8], last_position=8, next_prompt_token=-1),
    ], block_tables=tables, t_pad=16, r_pad=3, block_size=bs)
    check(x, cache, {0: a_full, 1: b_full})


def test_mtp_needs_an_mtp_layer_and_names_the_family():
    from mrv2_jax.spec_decode.config import SpeculativeConfig
    from mrv2_jax.spec_decode.factory import build_spec_decoder

    spec, lm, _ = load_model(FIXTURES / "glm4-moe-tiny-plain", dtype="float32")  # no MTP layer
    with pytest.raises(NotImplementedError, match="Glm4MoeForCausalLM"):
        build_spec_decoder(SpeculativeConfig.parse({"method": "mtp", "k": 2}), spec, lm, num_blocks=8,
                           block_size=4, max_num_seqs=2, max_model_len=32, kv_dtype=jnp.float32,
                           dtype="float32", use_kernels=False)


# --- engine outputs -------------------------------------------------------------------------

# Greedy batches only: the greedy sampler variant, about a third of `all`'s compile on a CPU, runs them.
# One bucket size (4 tokens): k = 1 gets one bucket, k = 3 that and its uniform-decode (4, 1) one.
ENGINE_ARGS = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=4, max_model_len=40,
                   num_gpu_blocks=24, block_size=4, sampler_variants="greedy,all", show_progress=False,
                   bucket_token_sizes=(4,))
PROMPT_LENGTHS = (5, 11, 3, 17)  # a 4-token budget chunks the prompts
MAX_TOKENS = (9, 6, 12, 7)


@functools.cache
def prompts_and_expected():
    from tests.engine_reference import greedy_reference

    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 64, n)] for n in PROMPT_LENGTHS]
    return prompts, [greedy_reference(MODEL, p, n) for p, n in zip(prompts, MAX_TOKENS)]


@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_outputs_unchanged(runner, k):
    from mrv2_jax.llm import LLM
    from mrv2_jax.sampling_params import SamplingParams

    prompts, expected = prompts_and_expected()
    llm = LLM(str(MODEL), runner=runner, async_scheduling=runner == "v2",
              speculative_config={"method": "mtp", "num_speculative_tokens": k}, **ENGINE_ARGS)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    for async_scheduling in ((True, False) if runner == "v2" else (False,)):
        llm.engine.async_scheduling = async_scheduling
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected, (runner, k, async_scheduling)
    stats = llm.engine.scheduler.get_stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= k * stats.num_drafts // 2
    assert llm.engine.compile_guard.num_unexpected == 0
