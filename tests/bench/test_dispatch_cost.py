"""benchmarks.dispatch_cost's count of device buffers that move between calls of one step (the
runner's donated state and the weights must stay where they are, call after call), its twin
executable (a second loaded copy that computes what the first does), and its capture of a step
that admits prompts beside decoding rows (with the decode step before it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.dispatch_cost import (
    capture_decode_dispatch,
    capture_prompt_dispatch,
    hollow_of,
    moved_buffers,
    put_and_hold,
    replay_room,
)
from mrv2_jax.llm import LLM
from mrv2_jax.runner.step_twins import load_twin


def _demo_llm():
    # The captured requests sample at temperature 1: the plain variant (as on GPUs) covers them and
    # compiles faster than `all`.
    return LLM("demo", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, num_gpu_blocks=16,
               max_fused_steps=1, sampler_variants="plain,all", show_progress=False)


def _captured_demo_step():
    llm = _demo_llm()
    compiled, packed = capture_decode_dispatch(llm, rows=2, output_len=8, input_len=4)
    return llm.engine.runner, compiled, packed


@pytest.mark.gpu  # XLA:CPU cannot serialize the step's executables ("`LessThan` is not serializable")
def test_a_twin_step_computes_what_the_step_computes():
    runner, compiled, packed = _captured_demo_step()
    # The same step from the same state, once through the compiled program, once through its twin.
    twin = load_twin(compiled)
    assert twin is not compiled
    start = jax.tree.map(np.asarray, (runner.kv_cache, runner.state, runner.slot_state, runner.spec_state))
    first = jax.tree.map(np.asarray, (runner.call_step(compiled, np.array(packed)), runner.kv_cache, runner.state))
    runner.kv_cache, runner.state, runner.slot_state, runner.spec_state = jax.tree.map(jax.device_put, start)
    second = jax.tree.map(np.asarray, (runner.call_step(twin, np.array(packed)), runner.kv_cache, runner.state))
    jax.tree.map(np.testing.assert_array_equal, first, second)


def test_donated_state_and_weights_keep_their_addresses():
    runner, compiled, packed = _captured_demo_step()
    moves = moved_buffers(runner, compiled, packed, calls=4)
    for group in ("params", "kv_cache", "state", "slot_state", "spec_params", "spec_state"):
        assert moves["arguments"][group] == 0, (group, moves)
    for group in ("kv_cache", "state", "slot_state", "spec_state"):
        assert moves["results"][group] == 0, (group, moves)
    # The step's own result is a fresh set of buffers: at least one leaf, each its own allocation.
    result = runner.call_step(compiled, jax.device_put(np.array(packed)))
    assert 0 < moves["results"]["result"] <= len(jax.tree.leaves(result))


def test_the_hollow_step_keeps_the_state_in_place_and_returns_zeros_like_the_step():
    runner, compiled, packed = _captured_demo_step()
    hollow = hollow_of(runner, compiled, packed)
    real = jax.tree.map(np.asarray, runner.call_step(compiled, np.array(packed)))
    # Read through copies: on the CPU a numpy view of an array keeps its buffer from being donated.
    before = jax.tree.map(lambda x: np.asarray(jnp.copy(x)), (runner.kv_cache, runner.state, runner.slot_state))
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((runner.kv_cache, runner.state))]
    result = jax.tree.map(np.asarray, runner.call_step(hollow, jax.device_put(np.array(packed))))
    # The donated state comes back unchanged, in the buffers it went in with (aliased, not copied).
    jax.tree.map(np.testing.assert_array_equal, before, (runner.kv_cache, runner.state, runner.slot_state))
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves((runner.kv_cache, runner.state))] == pointers
    # Its result has the step's shapes and dtypes, all zeros.
    assert jax.tree.structure(result) == jax.tree.structure(real)
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(real), strict=True):
        assert (got.shape, got.dtype) == (want.shape, want.dtype) and not got.any()


def test_replay_room_is_the_calls_that_keep_the_rows_within_max_model_len():
    runner, compiled, packed = _captured_demo_step()
    # The captured rows finished at 4 prompt + 8 output tokens; the engine's max_model_len is 64.
    room = replay_room(runner, compiled, packed, max_model_len=64)
    assert room == 64 - (4 + 8)
    for _ in range(room):  # each call of the captured step advances its two rows by one token
        runner.call_step(compiled, np.array(packed))
    assert np.asarray(runner.state.num_tokens)[:2].tolist() == [64, 64]
    assert replay_room(runner, compiled, packed, max_model_len=64) == 0


def test_put_and_hold_hands_the_step_a_device_buffer_kept_until_the_next_call():
    import gc
    import weakref

    got = []
    call = put_and_hold(lambda packed: got.append(weakref.ref(packed)) or packed * 2)
    first = np.arange(4, dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(call(first)), first * 2)
    gc.collect()
    assert isinstance(got[0](), jax.Array)  # on the device, and still alive after its call
    np.testing.assert_array_equal(np.asarray(call(first + 1)), (first + 1) * 2)
    gc.collect()
    assert got[0]() is None and got[1]() is not None  # released once the next call's buffer exists


def test_the_prompt_step_capture_keeps_the_step_that_admits_beside_decoding_rows():
    llm = _demo_llm()
    prompt, decode = capture_prompt_dispatch(llm, rows=1, admit=1, input_len=4, output_len=8)
    compiled, packed = prompt.compiled, prompt.packed
    runner = llm.engine.runner
    bucket, (layout, _) = next((b, entry) for b, entry in runner.compiled.items() if compiled in entry[1])
    assert not runner.unrolls_layers(bucket)  # CPUs keep the layer loop by default
    # One decoding row and one new request of 4 prompt tokens: 5 tokens, one new slot.
    assert int(layout.view(packed, "num_reqs")) == 2
    assert layout.view(packed, "num_scheduled")[:2].tolist() == [1, 4]
    assert (layout.view(packed, "new_slot") >= 0).sum() == 1
    # Called again and again, it keeps the donated state and the weights in place, as a decode step does.
    moves = moved_buffers(runner, compiled, packed, calls=3)
    assert all(moves["arguments"][group] == 0 for group in ("params", "kv_cache", "state", "slot_state"))
    # Beside it, the decode step before the admission: the one row alone, one token.
    decode_layout = next(entry[0] for entry in runner.compiled.values() if decode.compiled in entry[1])
    assert int(decode_layout.view(decode.packed, "num_reqs")) == 1
    assert decode_layout.view(decode.packed, "num_scheduled")[:1].tolist() == [1]
