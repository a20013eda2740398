"""Model Runner V2: device-side input preparation, identical outputs across the three arms
(v1, v2-sync, v2-async), a provably asynchronous pipeline, and no compiles after warm-up."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.runner import prepare, v2
from mrv2_jax.runner.device_state import SAMPLING_FIELDS, init_device_state
from mrv2_jax.sampling_params import SamplingParams
from tests.engine_reference import greedy_reference
from tests.parity import FIXTURES

MODEL = FIXTURES / "qwen3-tiny"
ARMS = [("v1", False), ("v2", False), ("v2", True)]

# The input preparation jitted, as in the step: run op by op, each op would compile a small XLA program.
_prepare_inputs = jax.jit(prepare.prepare_inputs, static_argnums=5)
_post_update = jax.jit(prepare.post_update)
_diverged_rows = jax.jit(prepare.diverged_rows)
_apply_new_requests = jax.jit(prepare.apply_new_requests)
_apply_block_writes = jax.jit(prepare.apply_block_writes)


def make_llm(runner, async_scheduling, **overrides):
    # 26 blocks of 4 tokens force preemptions; test_sampling_engine's engines have this shape.
    args = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96,
                num_gpu_blocks=26, block_size=4, show_progress=False)
    return LLM(str(MODEL), runner=runner, async_scheduling=async_scheduling, **(args | overrides))


@functools.cache
def _engine_of(runner):
    # The widest sampler variant alone serves the arm tests' greedy and seeded batches (as
    # test_sampling_engine's engines, whose programs these share).
    return make_llm(runner, runner == "v2", sampler_variants="all")


def arm_llm(runner, async_scheduling):
    """The arm's engine: one per runner, shared by the arm tests; v2-sync and v2-async are the same
    engine with its loop switched (the loop is all that differs, and it holds no step in flight
    between two generate() calls)."""
    llm = _engine_of(runner)
    llm.engine.async_scheduling = async_scheduling
    return llm


# --- input preparation against a plain loop ----------------------------------------------------

def random_state(rng, num_slots=6, max_len=40, max_blocks=10, block_size=4):
    state = init_device_state(num_slots, max_len, max_blocks)
    prefill_len = rng.integers(1, 30, num_slots)
    num_tokens = prefill_len + rng.integers(0, 5, num_slots)
    num_computed = np.minimum(rng.integers(0, 30, num_slots), num_tokens - 1)
    state = with_columns(state, num_tokens=num_tokens, prefill_len=prefill_len, num_computed=num_computed)
    return state._replace(
        token_ids=jnp.asarray(rng.integers(0, 1000, (num_slots, max_len + 1)), jnp.int32),
        block_table=jnp.asarray(rng.permutation(num_slots * max_blocks).reshape(num_slots, max_blocks), jnp.int32))


def with_columns(state, **columns):
    """`state` with whole per-slot columns (num_tokens, ...) replaced."""
    scalars, every_slot = state.scalars, jnp.arange(state.token_ids.shape[0])
    for name, values in columns.items():
        scalars = scalars.set_at(name, every_slot, jnp.asarray(values))
    return state._replace(scalars=scalars)


def reference_prepare(state, idx_mapping, num_scheduled, num_reqs, chunk_tokens, block_size):
    """The same inputs, built token by token in plain Python."""
    tables = {k: np.array(getattr(state, k)) for k in (
              "token_ids", "block_table", "num_computed", "prefill_len", "num_tokens")}
    t_pad, r_pad = len(chunk_tokens), len(idx_mapping)
    ids, pos, slots = np.zeros(t_pad, int), np.zeros(t_pad, int), np.full(t_pad, -1)
    qsl, seq_lens, logits_idx, samples = [0], np.zeros(r_pad, int), np.zeros(r_pad, int), np.zeros(r_pad, bool)
    t = 0
    for r in range(num_reqs):
        s, n = idx_mapping[r], num_scheduled[r]
        start = tables["num_computed"][s]
        for j in range(n):
            p = start + j
            if p < tables["prefill_len"][s]:
                tables["token_ids"][s, p] = chunk_tokens[t]
            ids[t], pos[t] = tables["token_ids"][s, p], p
            slots[t] = tables["block_table"][s, p // block_size] * block_size + p % block_size
            t += 1
        qsl.append(t)
        seq_lens[r] = start + n
        logits_idx[r] = max(t - 1, 0)
        samples[r] = n > 0 and start + n >= tables["num_tokens"][s]
    qsl += [t] * (r_pad - num_reqs)
    for r in range(num_reqs, r_pad):
        logits_idx[r] = max(qsl[r + 1] - 1, 0)
    return ids, pos, slots, np.array(qsl), seq_lens, logits_idx, samples, tables["token_ids"]


@pytest.mark.parametrize("seed", range(6))
def test_prepare_inputs_matches_plain_loop(seed):
    rng = np.random.default_rng(seed)
    state = random_state(rng)
    num_reqs = int(rng.integers(0, 5))
    idx_mapping = np.zeros(5, np.int32)
    idx_mapping[:num_reqs] = rng.permutation(6)[:num_reqs]
    nc, nt = np.array(state.num_computed), np.array(state.num_tokens)
    num_scheduled = np.zeros(5, np.int32)
    for r in range(num_reqs):  # never past the known tokens, as the scheduler guarantees
        num_scheduled[r] = rng.integers(0, nt[idx_mapping[r]] - nc[idx_mapping[r]] + 1)
    chunk = rng.integers(0, 1000, 32).astype(np.int32)
    new_state, inputs = _prepare_inputs(state, jnp.asarray(idx_mapping), jnp.asarray(num_scheduled),
                                        jnp.int32(num_reqs), jnp.asarray(chunk), 4)
    ids, pos, slots, qsl, seq_lens, logits_idx, samples, token_ids = reference_prepare(
        state, idx_mapping, num_scheduled, num_reqs, chunk, 4)
    total = qsl[num_reqs] if num_reqs else 0
    np.testing.assert_array_equal(np.array(inputs.input_ids)[:total], ids[:total])
    np.testing.assert_array_equal(np.array(inputs.positions)[:total], pos[:total])
    np.testing.assert_array_equal(np.array(inputs.slot_mapping), slots)
    np.testing.assert_array_equal(np.array(inputs.query_start_loc), qsl)
    np.testing.assert_array_equal(np.array(inputs.seq_lens), seq_lens)
    np.testing.assert_array_equal(np.array(inputs.samples), samples)
    np.testing.assert_array_equal(np.array(inputs.logits_indices)[:num_reqs], logits_idx[:num_reqs])
    np.testing.assert_array_equal(np.array(new_state.token_ids), token_ids)
    np.testing.assert_array_equal(np.array(inputs.block_tables)[:num_reqs],
                                  np.array(state.block_table)[idx_mapping[:num_reqs]])

    sampled = rng.integers(0, 1000, 5).astype(np.int32)
    after = _post_update(new_state, jnp.asarray(idx_mapping), jnp.int32(num_reqs), inputs, jnp.asarray(sampled))
    after_computed, after_tokens, after_num_tokens = (np.asarray(a) for a in (after.num_computed, after.token_ids,
                                                                               after.num_tokens))
    for r in range(num_reqs):
        s = idx_mapping[r]
        assert int(after_computed[s]) == seq_lens[r]
        if samples[r]:
            assert int(after_tokens[s, seq_lens[r]]) == int(sampled[r])
            assert int(after_num_tokens[s]) == seq_lens[r] + 1
        else:
            assert int(after_num_tokens[s]) == nt[s]


@pytest.mark.parametrize("seed", range(4))
def test_diverged_rows_match_plain_loop(seed):
    """Flagged: a scheduled row past its prefill whose token count is not one past its computed
    tokens; never a padding row, an unscheduled one or one still prefilling."""
    rng = np.random.default_rng(100 + seed)
    prefill = rng.integers(1, 20, 6)
    kind = rng.integers(0, 3, 6)  # 0: prefilling, 1: decoding, 2: decoding with a count off by one or two
    computed = np.where(kind == 0, rng.integers(0, prefill), prefill + rng.integers(0, 10, 6))
    known = np.where(kind == 0, prefill, computed + 1) + np.where(kind == 2, rng.choice([-1, 1], 6), 0)
    state = with_columns(random_state(rng), prefill_len=prefill, num_computed=computed, num_tokens=known)
    num_reqs = int(rng.integers(1, 6))
    idx_mapping = np.zeros(5, np.int32)
    idx_mapping[:num_reqs] = rng.permutation(6)[:num_reqs]
    num_scheduled = rng.integers(0, 3, 5).astype(np.int32)
    got = _diverged_rows(state, jnp.asarray(idx_mapping), jnp.asarray(num_scheduled), jnp.int32(num_reqs))
    nc, nt, prefill = (np.array(getattr(state, f)) for f in ("num_computed", "num_tokens", "prefill_len"))
    want = [bool(r < num_reqs and num_scheduled[r] > 0 and nc[s] >= prefill[s] and nt[s] != nc[s] + 1)
            for r, s in enumerate(idx_mapping)]
    assert np.asarray(got).tolist() == want


def test_new_requests_and_block_writes_reuse_freed_slots():
    state = random_state(np.random.default_rng(9))
    state = _apply_new_requests(
        state, jnp.array([3, -1, 0], jnp.int32), jnp.array([7, 99, 5], jnp.int32), jnp.array([4, 99, 0], jnp.int32),
        num_prompt=jnp.array([6, 99, 5], jnp.int32), sampler_row=jnp.array([3, 99, -1], jnp.int32),
        sampling={"temperature": jnp.array([0.5, 9.0, 0.0], jnp.float32), "seeds": jnp.array([11, 99, 12], jnp.int32)})
    assert np.array(state.num_tokens)[[3, 0]].tolist() == [7, 5]
    assert np.array(state.num_computed)[[3, 0]].tolist() == [4, 0]
    assert np.array(state.num_prompt)[[3, 0]].tolist() == [6, 5]
    assert np.array(state.sampler_row)[[3, 0]].tolist() == [3, -1]
    sampling = {name: np.asarray(state.scalars[name]) for name in SAMPLING_FIELDS}
    assert float(sampling["temperature"][3]) == 0.5 and int(sampling["seeds"][0]) == 12
    assert float(sampling["top_p"][3]) == 1.0  # fields not given are neutral
    before = np.array(state.block_table)
    state = _apply_block_writes(state, jnp.array([3, -1, 3], jnp.int32), jnp.array([0, 5, 1], jnp.int32),
                                jnp.array([42, 77, 43], jnp.int32))
    expected = before.copy()
    expected[3, :2] = [42, 43]
    np.testing.assert_array_equal(np.array(state.block_table), expected)


# --- the three arms agree -------------------------------------------------------------------

def mixed_workload():
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(3, 96, 24)]  # a shared prefix for prefix-cache hits
    prompts = []
    for i, k in enumerate(rng.integers(1, 40, 64)):
        tail = [int(t) for t in rng.integers(3, 96, k)]
        prompts.append(shared + tail[:8] if i % 4 == 0 else tail)
    return prompts


@pytest.fixture(scope="module")
def arm_outputs():
    prompts = mixed_workload()
    params = []
    for i, prompt in enumerate(prompts):
        max_tokens = int(6 + i % 7)
        # Every fifth request stops on a token its greedy output really produces.
        stop = [greedy_reference(MODEL, prompt, max_tokens)[3]] if i % 5 == 0 else None
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=stop))
    outputs = {}
    for runner, async_scheduling in ARMS:
        llm = arm_llm(runner, async_scheduling)
        scheduler = llm.engine.scheduler
        preemptions, hits = scheduler.num_preemptions, scheduler.kv_cache_manager.prefix_cache_hits
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs[(runner, async_scheduling)] = dict(
            tokens=[o.outputs[0].token_ids for o in outs], reasons=[o.outputs[0].finish_reason for o in outs],
            preemptions=scheduler.num_preemptions - preemptions,
            hits=scheduler.kv_cache_manager.prefix_cache_hits - hits,
            free=scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks)
    return prompts, params, outputs


def test_greedy_outputs_identical_across_arms(arm_outputs):
    prompts, params, outputs = arm_outputs
    v1 = outputs[("v1", False)]
    for arm, out in outputs.items():
        assert out["tokens"] == v1["tokens"], arm
        assert out["reasons"] == v1["reasons"], arm
        assert out["preemptions"] > 0 and out["hits"] > 0 and out["free"], arm
    assert "stop" in v1["reasons"]


def test_greedy_outputs_match_plain_loop(arm_outputs):
    prompts, params, outputs = arm_outputs
    for i in range(0, 64, 5):
        expected = greedy_reference(MODEL, prompts[i], params[i].max_tokens)
        stop = params[i].stop_token_ids
        if stop:
            expected = expected[: expected.index(stop[0]) + 1]
        assert outputs[("v2", True)]["tokens"][i] == expected


def test_seeded_sampling_identical_across_arms():
    prompts = mixed_workload()[:12]
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(12)]
    results = [[o.outputs[0].token_ids for o in arm_llm(r, a).generate(prompts, params, use_tqdm=False)]
               for r, a in ARMS]
    assert results[0] == results[1] == results[2]


# --- the pipeline is really asynchronous ----------------------------------------------------------

def test_async_dispatches_next_step_before_reading_previous(monkeypatch):
    events = []
    llm = arm_llm("v2", True)  # the arm tests' engine, whose programs they compiled or will use
    runner = llm.engine.runner
    real_execute, real_result = runner.execute, v2.PendingStep.result
    num_dispatched = 0

    def execute(out):
        nonlocal num_dispatched
        # No device->host transfer may happen while a step is prepared and dispatched.
        with jax.transfer_guard_device_to_host("disallow"):
            pending = real_execute(out)
        if isinstance(pending, v2.PendingStep):  # (an empty schedule dispatches nothing)
            pending.step_number = num_dispatched
            events.append(("dispatch", num_dispatched))
            num_dispatched += 1
        return pending

    def result(self):
        events.append(("read", self.step_number))
        return real_result(self)

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(v2.PendingStep, "result", result)
    llm.generate(mixed_workload()[:10], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    reads = [n for kind, n in events if kind == "read"]
    assert len(reads) > 5
    for n in reads:
        # Step n's tokens are read only after step n + 1 was dispatched (or n was the last).
        read_at = events.index(("read", n))
        assert ("dispatch", n + 1) in events[:read_at] or ("dispatch", n + 1) not in events


def test_no_compiles_after_warmup_with_changing_batches():
    from mrv2_jax.runner.compile_guard import num_compiles

    llm = make_llm("v2", True, max_num_batched_tokens=64)
    before = num_compiles()
    rng = np.random.default_rng(5)
    for batch in (1, 7, 3, 16):  # changing batch sizes and prompt lengths
        prompts = [[int(t) for t in rng.integers(3, 96, k)] for k in rng.integers(1, 60, batch)]
        llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.5, seed=1, ignore_eos=True),
                     use_tqdm=False)
    assert num_compiles() == before
    assert llm.engine.compile_guard.num_unexpected == 0
