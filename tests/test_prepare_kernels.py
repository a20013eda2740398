"""Input-preparation kernels (pallas_kernels/prepare_inputs.py) vs the jnp references of
mrv2_jax/runner/prepare.py, which test_runner_v2.py checks against a plain Python loop.

The main test drives both implementations in lockstep through a few engine-like steps on the
same device state: requests arrive (some with a prefix-cache hit, i.e. prior context) into
free slots, whose token-table rows still hold the previous owner's tokens; rows prefill in
chunks that cross the kernel's tile boundaries, then decode; some rows get zero tokens; the
batch order is shuffled; padding rows carry zeros or garbage slot indices; the token bucket
has padding. Every output and every table must match exactly, padding values included. In
interpret mode Pallas fills integer outputs with INT_MIN first, so an element the kernel
forgets to write cannot pass.

On the CPU the kernels run in the Pallas interpreter; `-m gpu` runs the compiled kernels at
serving shapes. `test_kernels_lower_to_triton` lowers them to Triton IR on the CPU (with a
faked GPU description), which catches Pallas-to-Triton lowering errors without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.runner import prepare
from mrv2_jax.runner.device_state import init_device_state
from mrv2_jax.runner.prepare import StepInputs
from pallas_kernels import prepare_inputs as pk
from tests.triton_lowering import verify_triton_lowering

ON_GPU = jax.default_backend() == "gpu"


def assert_same(got, want):
    """Exact equality of two pytrees of arrays (StepInputs / DeviceState)."""
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree_util.tree_leaves_with_path(want)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        name = jax.tree_util.keystr(path)
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(g, w, err_msg=name)


# --- a tiny engine: the host side of a few V2 steps -------------------------------------------

class Engine:
    """Admits, schedules and retires requests like the scheduler + V2 host path would, on
    slots of a shared device state (both implementations step from the same state)."""

    def __init__(self, rng, *, num_slots, max_model_len, block_size, max_prompt=30):
        self.rng, self.bs, self.max_prompt = rng, block_size, max_prompt
        self.max_blocks = -(-max_model_len // block_size)
        self.max_len = max_model_len
        state = init_device_state(num_slots, max_model_len, self.max_blocks)
        # Stale contents everywhere: a reused slot must never read its previous owner's data.
        self.state = state._replace(token_ids=jnp.asarray(
            rng.integers(1000, 2000, state.token_ids.shape), jnp.int32))
        self.free = list(range(num_slots))
        self.live = {}  # slot -> (prompt, final length)
        self.ever_used, self.reused = set(), 0  # slots given to a second request

    def retire_and_admit(self, max_new):
        nt = np.asarray(self.state.num_tokens)
        for slot, (_, final) in list(self.live.items()):
            if nt[slot] >= final:  # finished: free the slot, its table rows stay stale
                del self.live[slot]
                self.free.append(slot)
        self.rng.shuffle(self.free)
        new = [self.free.pop() for _ in range(min(max_new, len(self.free)))]
        n = len(new)
        prompts = [self.rng.integers(0, 1000, self.rng.integers(1, self.max_prompt)) for _ in new]
        # A prefix-cache hit starts the request at a block boundary inside its prompt.
        computed = [self.bs * self.rng.integers(0, (len(p) - 1) // self.bs + 1) for p in prompts]
        for slot, p in zip(new, prompts):
            self.reused += slot in self.ever_used
            self.ever_used.add(slot)
            self.live[slot] = (p, min(len(p) + int(self.rng.integers(1, 8)), self.max_len))
            blocks = self.rng.permutation(4 * self.max_blocks)[: self.max_blocks]
            self.state = self.state._replace(block_table=self.state.block_table.at[slot].set(blocks))
        pad = lambda xs, fill: jnp.asarray(list(xs) + [fill] * (max_new - n), jnp.int32)  # noqa: E731
        self.state = prepare.apply_new_requests(
            self.state, pad(new, -1), pad(map(len, prompts), 0), pad(computed, 0))

    def schedule(self, num_rows, num_tokens):
        """(idx_mapping, num_scheduled, num_reqs, chunk_tokens) for one step."""
        rng = self.rng
        nc, nt = np.asarray(self.state.num_computed), np.asarray(self.state.num_tokens)
        slots = list(self.live)
        rng.shuffle(slots)
        slots = slots[:num_rows]
        idx = np.zeros(num_rows, np.int32)
        if rng.random() < 0.5:  # garbage in padding rows: must be read the way jnp reads it
            idx[:] = rng.integers(-2 * len(nc), 2 * len(nc), num_rows)
        counts = np.zeros(num_rows, np.int32)
        chunk = rng.integers(5000, 6000, num_tokens).astype(np.int32)  # garbage off-prompt
        used = 0
        for r, slot in enumerate(slots):
            idx[r] = slot
            remaining = nt[slot] - nc[slot]
            n = remaining if rng.random() < 0.6 else rng.integers(0, remaining + 1)
            if rng.random() < 0.1:
                n = 0  # a zero-token row
            n = int(min(n, num_tokens - used))
            prompt = self.live[slot][0]
            for j in range(n):
                if nc[slot] + j < len(prompt):
                    chunk[used + j] = prompt[nc[slot] + j]
            counts[r] = n
            used += n
        return jnp.asarray(idx), jnp.asarray(counts), jnp.int32(len(slots)), jnp.asarray(chunk)


@functools.lru_cache(maxsize=None)
def jitted(name, **kw):
    if name == "ref_prepare":
        return jax.jit(prepare.prepare_inputs, static_argnums=5)
    if name == "ref_post":
        return jax.jit(prepare.post_update)
    fn = pk.prepare_inputs if name == "prepare" else pk.post_update
    return jax.jit(functools.partial(fn, interpret=not ON_GPU, **kw))


def run_steps(seed, *, num_slots, max_model_len, block_size, num_rows, num_tokens, steps,
              max_new, max_prompt=30, **tuning):
    rng = np.random.default_rng(seed)
    eng = Engine(rng, num_slots=num_slots, max_model_len=max_model_len, block_size=block_size,
                 max_prompt=max_prompt)
    kernel_prepare = jitted("prepare", block_size=block_size, **tuning)
    kernel_post = jitted("post")
    saw = dict(decode=0, prefill_with_context=0, zero=0, padded_tokens=0)
    for _ in range(steps):
        eng.retire_and_admit(max_new)
        batch = eng.schedule(num_rows, num_tokens)
        want_state, want = jitted("ref_prepare")(eng.state, *batch, block_size)
        got_state, got = kernel_prepare(eng.state, *batch)
        assert_same(got, want)
        assert_same(got_state, want_state)

        sampled = jnp.asarray(rng.integers(0, 1000, num_rows), jnp.int32)
        after = jitted("ref_post")(want_state, batch[0], batch[2], want, sampled)
        assert_same(kernel_post(want_state, batch[0], batch[2], want, sampled), after)

        # Bookkeeping of what the batches covered (checked below, so the test stays honest).
        idx, counts, num_reqs = np.asarray(batch[0]), np.asarray(batch[1]), int(batch[2])
        nc, pl_ = np.asarray(eng.state.num_computed), np.asarray(eng.state.prefill_len)
        for r in range(num_reqs):
            s, n = idx[r], counts[r]
            saw["zero"] += n == 0
            saw["decode"] += n == 1 and nc[s] >= pl_[s]
            saw["prefill_with_context"] += n > 1 and 0 < nc[s] < pl_[s]
        saw["padded_tokens"] += counts[:num_reqs].sum() < num_tokens
        eng.state = after
    saw["reused_slots"] = eng.reused
    return saw


# --- CPU (interpret mode) -------------------------------------------------------------------------

SMALL = dict(num_slots=8, max_model_len=48, block_size=4, num_rows=6, num_tokens=40)


@pytest.mark.parametrize("tuning", [
    dict(block_t=4, num_splits=1),  # many tiles per row, each chunk crosses tile boundaries
    dict(block_t=8, num_splits=3),  # a row's tiles dealt to three programs
    dict(),  # the defaults: one 256-token tile per row
], ids=["t4", "t8_split3", "default"])
def test_steps_match_reference(tuning):
    saw = run_steps(0, steps=10, max_new=3, **SMALL, **tuning)
    assert all(saw.values()), saw  # every kind of row/batch showed up


def test_decode_bucket_matches_reference():
    """A decode-shaped bucket (T == R): the small-tile default tuning."""
    saw = run_steps(1, num_slots=10, max_model_len=40, block_size=4, num_rows=8, num_tokens=8,
                    steps=8, max_new=4)
    assert saw["decode"], saw


@pytest.mark.parametrize("max_blocks,block_b", [(5, None), (16, 4), (13, 4)])
def test_gather_block_tables(max_blocks, block_b):
    rng = np.random.default_rng(max_blocks)
    table = jnp.asarray(rng.integers(0, 10_000, (7, max_blocks)), jnp.int32)
    idx = jnp.asarray([3, 0, 6, 3, -1, -9, 12], jnp.int32)  # repeats, negative, out of range
    got = jax.jit(functools.partial(pk.gather_block_tables, interpret=True, block_b=block_b))(table, idx)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(table[idx]))


def test_post_update_edge_cases():
    """Padding rows that sample into unused slots, out-of-range slots, a token past the table."""
    S, width, R = 6, 9, 5
    rng = np.random.default_rng(5)
    state = init_device_state(S, width - 1, 3)._replace(
        token_ids=jnp.asarray(rng.integers(0, 100, (S, width)), jnp.int32),
        num_tokens=jnp.arange(S, dtype=jnp.int32), num_computed=jnp.arange(S, dtype=jnp.int32) * 2)
    idx = jnp.asarray([4, 1, 2, 7, -6], jnp.int32)  # rows 3, 4 are padding; -6 means slot 0
    seq_lens = jnp.asarray([9, 3, 8, 4, 5], jnp.int32)  # row 0's token would land past the row
    samples = jnp.asarray([True, False, True, True, True])
    inputs = StepInputs(*(jnp.zeros(8, jnp.int32),) * 3, query_start_loc=jnp.zeros(R + 1, jnp.int32),
                        seq_lens=seq_lens, logits_indices=jnp.zeros(R, jnp.int32),
                        block_tables=jnp.zeros((R, 3), jnp.int32), samples=samples)
    sampled = jnp.asarray([11, 12, 13, 14, 15], jnp.int32)
    want = prepare.post_update(state, idx, jnp.int32(3), inputs, sampled)
    got = pk.post_update(state, idx, jnp.int32(3), inputs, sampled, interpret=True)
    assert_same(got, want)


def test_prepare_ops_selects_implementation():
    ref = pk.prepare_ops(False)
    assert ref.prepare_inputs is prepare.prepare_inputs and ref.post_update is prepare.post_update
    ops = pk.prepare_ops(True, interpret=True)
    assert ops.prepare_inputs.func is pk.prepare_inputs and ops.prepare_inputs.keywords == {"interpret": True}
    assert ops.apply_new_requests is prepare.apply_new_requests


@pytest.mark.parametrize("num_rows,num_tokens", [(256, 256), (256, 8192)], ids=["decode", "mixed"])
def test_kernels_lower_to_triton(monkeypatch, num_rows, num_tokens):
    """Lower all three kernels for CUDA at serving shapes (default tuning) and verify the
    Triton IR, without a GPU: the registration only needs the GPU's compute capability."""
    verified = verify_triton_lowering(monkeypatch)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    state = jax.eval_shape(lambda: init_device_state(1024, 4096, 256))
    R, T = num_rows, num_tokens
    text = jax.jit(functools.partial(pk.prepare_inputs, block_size=16)).trace(
        state, i32(R), i32(R), i32(), i32(T)).lower(lowering_platforms=("cuda",)).as_text()
    inputs = StepInputs(i32(T), i32(T), i32(T), i32(R + 1), i32(R), i32(R), i32(R, 256),
                        jax.ShapeDtypeStruct((R,), jnp.bool_))
    text += jax.jit(pk.post_update).trace(state, i32(R), i32(), inputs, i32(R)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
    assert verified == [True] * 3


# --- GPU (compiled) -------------------------------------------------------------------------------

SERVING = dict(num_slots=64, max_model_len=1024, block_size=16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows,num_tokens,max_prompt,max_new",
                         [(32, 32, 6, 6), (32, 512, 200, 32), (16, 2048, 900, 16)],
                         ids=["decode", "mixed", "prefill"])
def test_gpu_steps_match_reference(num_rows, num_tokens, max_prompt, max_new):
    saw = run_steps(2, steps=12, max_new=max_new, num_rows=num_rows, num_tokens=num_tokens,
                    max_prompt=max_prompt, **SERVING)
    assert saw["decode"] and saw["prefill_with_context"], saw


@pytest.mark.gpu
def test_gpu_in_place_under_donation():
    """Donated by the outer jit, the token table is updated in its own buffer (no copy)."""
    eng = Engine(np.random.default_rng(3), max_prompt=200, **SERVING)
    eng.retire_and_admit(32)
    batch = eng.schedule(32, 512)

    def step(state, idx, counts, num_reqs, chunk):
        state, inputs = pk.prepare_inputs(state, idx, counts, num_reqs, chunk, 16)
        return pk.post_update(state, idx, num_reqs, inputs, inputs.input_ids[:32]), inputs

    fn = jax.jit(step, donate_argnums=0)
    want_state, want = jitted("ref_prepare")(eng.state, *batch, 16)
    before = eng.state.token_ids.unsafe_buffer_pointer()
    state, got = fn(eng.state, *batch)
    assert state.token_ids.unsafe_buffer_pointer() == before
    assert_same(got, want)
