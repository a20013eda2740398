"""Streaming from inside fused decode calls (`stream_in_call`), through a real engine process on the
demo model: streams get their tokens one decode step at a time while the engine runs up to
max_fused_steps steps per call, and every output equals the offline `LLM.generate` (not streamed)
of an engine in this process with the same weights."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from mrv2_jax.async_llm import AsyncLLM
from mrv2_jax.sampling_params import SamplingParams
from tests.server_harness import ENGINE_ARGS, MODEL_NAME, make_llm, reference_llm, wait_until

LONG_PROMPT = "Once upon a time, in a far country,"
FUSED = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
STOP = dict(max_tokens=200, temperature=0.0, ignore_eos=True, stop=["books"])
PROMPTS = ["The king said", "ROMEO:\n", "To be, or not", "My lord, the queen"]
SAMPLED = [dict(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def engine_and_reference():
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(AsyncLLM.from_engine_args, MODEL_NAME, **ENGINE_ARGS, stream_in_call=True)
        llm = reference_llm()

        def offline(prompts, params):
            return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

        reference = {"fused": offline([LONG_PROMPT], SamplingParams(**FUSED))[0],
                     "stop": offline([LONG_PROMPT], SamplingParams(**STOP))[0],
                     "sampled": offline(PROMPTS, [SamplingParams(**kw) for kw in SAMPLED])}
        engine = starting.result()
    try:
        yield engine, reference
    finally:
        engine.shutdown()


async def _stream(engine, prompt, params) -> list:
    stream = await engine.generate(prompt, SamplingParams(**params), streaming=True)
    return [out async for out in stream]


def _steps(engine, run):
    """(the outputs of `run`, engine steps it took, fused calls it took)."""
    steps, calls = engine.stats.num_steps, engine.stats.num_fused_calls
    outputs = run()
    idle = engine.stats
    wait_until(lambda: engine.stats.num_running_reqs == 0 and engine.stats.num_free_blocks == idle.num_blocks,
               what="the requests to finish and free their blocks")
    return outputs, engine.stats.num_steps - steps, engine.stats.num_fused_calls - calls


def test_a_stream_gets_token_by_token_chunks_from_long_fused_calls(engine_and_reference):
    engine, reference = engine_and_reference
    chunks, steps, calls = _steps(engine, lambda: asyncio.run(_stream(engine, LONG_PROMPT, FUSED)))
    assert chunks[-1].outputs[0].text == reference["fused"] and chunks[-1].finished
    assert len(chunks[-1].outputs[0].token_ids) == FUSED["max_tokens"]
    # The stream interval (1) did not cap the calls: up to 16 decode steps each ...
    assert 1 <= calls and steps < FUSED["max_tokens"] / 4, (steps, calls)
    # ... and yet the stream got more chunks than the engine made steps: tokens left during calls.
    assert len(chunks) > steps + 2, (len(chunks), steps)
    assert "".join(c.delta_text for c in chunks) == reference["fused"]


def test_a_stop_string_ends_a_stream_found_in_the_streamed_tokens(engine_and_reference):
    engine, reference = engine_and_reference
    chunks, steps, _ = _steps(engine, lambda: asyncio.run(_stream(engine, LONG_PROMPT, STOP)))
    assert chunks[-1].outputs[0].text == reference["stop"] != "" and chunks[-1].outputs[0].finish_reason == "stop"
    assert steps < 25  # the engine finished it when the API process saw the stop string


def test_concurrent_sampled_streams_equal_offline(engine_and_reference):
    engine, reference = engine_and_reference

    async def all_streams():
        return await asyncio.gather(*(_stream(engine, p, kw) for p, kw in zip(PROMPTS, SAMPLED)))

    results, steps, calls = _steps(engine, lambda: asyncio.run(all_streams()))
    assert [chunks[-1].outputs[0].text for chunks in results] == reference["sampled"]
    assert calls >= 1 and steps < SAMPLED[0]["max_tokens"] / 2, (steps, calls)


def test_a_stream_with_logprobs_keeps_the_stream_interval(engine_and_reference):
    """Logprobs travel in the step outputs only: such a stream is capped by the stream interval
    (1 here), one step per call, and its tokens still equal the offline ones."""
    engine, reference = engine_and_reference
    params = FUSED | {"logprobs": 0}
    chunks, steps, calls = _steps(engine, lambda: asyncio.run(_stream(engine, LONG_PROMPT, params)))
    assert chunks[-1].outputs[0].text == reference["fused"]
    assert calls == 0 and steps >= FUSED["max_tokens"] - 1
    assert len(chunks[-1].outputs[0].logprobs) == FUSED["max_tokens"]


def test_a_bad_stream_in_call_is_refused_by_name():
    from mrv2_jax.engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match="stream_in_call must be a bool"):
        EngineConfig(model=MODEL_NAME, stream_in_call="yes")


def test_the_sink_gets_every_token_once_in_order_the_first_before_the_first_fused_call():
    """In process: a streaming request's tokens reach the token sink exactly once each, in order:
    the prefill's token when the first fused call is about to start (that call holds the host
    until it ends), every later one from inside the calls; they are the offline tokens."""
    from mrv2_jax.engine.request import Request

    llm = make_llm(stream_in_call=True)
    expected = llm.generate([LONG_PROMPT], SamplingParams(**FUSED), use_tqdm=False)[0].outputs[0].token_ids
    got, calls_at_arrival = [], []

    def sink(entries):
        got.extend(entries)
        calls_at_arrival.extend([llm.engine.runner.num_fused_calls] * len(entries))

    assert llm.engine.attach_token_sink(sink)
    calls = llm.engine.runner.num_fused_calls
    llm.engine.add_request(Request("s", llm.tokenizer.encode(LONG_PROMPT), SamplingParams(**FUSED), streaming=True))
    while llm.engine.has_work():
        llm.engine.step()
    assert [(r, i) for r, i, _ in got] == [("s", i) for i in range(FUSED["max_tokens"])]
    assert [t for _, _, t in got] == list(expected)
    assert calls_at_arrival[0] == calls  # token 0: before the first fused call
    assert llm.engine.runner.num_fused_calls - calls < FUSED["max_tokens"] / 4
