"""A decoding batch sends the same packed input step after step; while the bytes repeat, the V2
runner's call gets the device copy that an earlier call returned instead of the fresh host buffer
(runner/base.py `returning_its_input`, runner/v2.py `_dispatch`). The tokens must not change."""

import jax
import numpy as np

from mrv2_jax.llm import LLM
from mrv2_jax.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def make(runner: str) -> LLM:
    return LLM("demo", runner=runner, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
               num_gpu_blocks=16, block_size=16, max_fused_steps=1, show_progress=False)


def test_repeated_inputs_go_from_the_device_and_change_no_token():
    llm = make("v2")
    runner = llm.engine.runner
    calls = []  # (the host's packed bytes, the argument the call got)
    dispatch, call = runner.hooks, runner.call_step

    def recording(compiled, argument):
        calls.append(argument)
        return call(compiled, argument)

    class Hooks:  # the host's own packed buffer of each call, as the runner built it
        def dispatched(self, runner, compiled, packed, call_s):
            calls[-1] = (packed.tobytes(), calls[-1])

    runner.call_step, runner.hooks = recording, Hooks()
    got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)]
    runner.hooks = dispatch
    # The reference: the V1 runner, which builds every input on the host.
    want = [out.outputs[0].token_ids for out in make("v1").generate(PROMPTS, PARAMS)]
    assert got == want
    on_device = 0
    for (before, _), (data, argument) in zip(calls, calls[1:]):
        if isinstance(argument, jax.Array):  # only ever the same bytes as the call before, on the device
            on_device += 1
            assert data == before and np.asarray(argument).tobytes() == data
        else:
            assert isinstance(argument, np.ndarray)
    # Two rows decode 40 tokens with a new KV block every 16: most inputs repeat.
    assert on_device >= len(calls) // 2
