"""benchmarks.dispatch_cost's count of device buffers that move between calls of one step: the
runner's donated state and the weights must stay where they are, call after call."""

import jax
import numpy as np

from benchmarks.dispatch_cost import capture_decode_dispatch, moved_buffers
from mrv2_jax.llm import LLM


def test_donated_state_and_weights_keep_their_addresses():
    llm = LLM("demo", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, num_gpu_blocks=16,
              max_fused_steps=1, show_progress=False)
    compiled, packed = capture_decode_dispatch(llm, rows=2, output_len=8, input_len=4)
    runner = llm.engine.runner
    moves = moved_buffers(runner, compiled, packed, calls=4)
    for group in ("params", "kv_cache", "state", "slot_state", "spec_params", "spec_state"):
        assert moves["arguments"][group] == 0, (group, moves)
    for group in ("kv_cache", "state", "slot_state", "spec_state"):
        assert moves["results"][group] == 0, (group, moves)
    # The step's own result is a fresh set of buffers: at least one leaf, each its own allocation.
    result = runner.call_step(compiled, jax.device_put(np.array(packed)))
    assert 0 < moves["results"]["result"] <= len(jax.tree.leaves(result))
