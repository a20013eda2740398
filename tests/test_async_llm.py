"""AsyncLLM's threading and failure handling, on a stub engine (no model, no JAX): outputs reach
the right stream, a bad request fails alone, aborts free the request, and a failing step stops
the engine visibly (streams end with EngineDeadError, /health and new requests answer 503)."""

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from mrv2_jax.async_llm import AsyncLLM, EngineDeadError, RequestRejected
from mrv2_jax.engine.output import CompletionOutput, RequestMetrics, RequestOutput
from mrv2_jax.engine.scheduler_output import SchedulerStats
from mrv2_jax.entrypoints.openai_server import ServerThread
from mrv2_jax.sampling_params import SamplingParams
from tests.server_harness import wait_until

NUM_BLOCKS = 64


class StubLLM:
    """Stands in for `LLM`: every step, each request gets the token after its last one; a
    request holds one KV block while it runs. `fail_step` makes the next step raise; prompts
    starting with token 13 are refused by `add_request`."""

    def __init__(self, max_model_len=1000, step_delay=0.0):
        self.tokenizer = None
        self.model_state = SimpleNamespace(vocab_size=100, eos_token_ids=())
        self.requests: dict[str, dict] = {}
        self.fail_step = False
        self.step_delay = step_delay
        kv = SimpleNamespace(num_blocks=NUM_BLOCKS)
        self.scheduler = SimpleNamespace(max_model_len=max_model_len, kv_cache_manager=kv, get_stats=self._stats)
        self.engine = SimpleNamespace(scheduler=self.scheduler, has_work=lambda: bool(self.requests),
                                      check_request=lambda params: None, outputs_prefill_tokens=0, dispatched=None,
                                      runner=SimpleNamespace(automaton_capacity=(0, 0)))

    def _stats(self):
        self.scheduler.kv_cache_manager.num_free_blocks = NUM_BLOCKS - len(self.requests)
        return SchedulerStats(num_running_reqs=len(self.requests), num_waiting_reqs=0,
                              kv_cache_usage=len(self.requests) / NUM_BLOCKS, prefix_cache_queries=0,
                              prefix_cache_hits=0, num_preemptions=0, num_evicted_blocks=0)

    def add_request(self, token_ids, params, request_id, streaming=False):
        if token_ids[0] == 13:
            raise ValueError("unlucky prompt")
        limit = params.max_tokens or self.scheduler.max_model_len - len(token_ids)
        self.requests[request_id] = {"prompt": token_ids, "out": [], "limit": limit}

    def abort(self, ids):
        for i in ids:
            self.requests.pop(i, None)

    def step(self):
        if self.fail_step:
            raise RuntimeError("device fell over")
        time.sleep(self.step_delay)
        outputs = []
        for rid, r in list(self.requests.items()):
            r["out"].append(((r["out"] or r["prompt"])[-1] + 1) % 100)
            done = len(r["out"]) >= r["limit"]
            outputs.append(RequestOutput(rid, None, r["prompt"], [CompletionOutput(
                "", list(r["out"]), "length" if done else None)], done, RequestMetrics(0.0)))
            if done:
                del self.requests[rid]
        return outputs


@pytest.fixture
def stub():
    llm = StubLLM()
    engine = AsyncLLM(llm)
    yield llm, engine
    engine.shutdown()


async def _collect(engine, prompt, **params):
    stream = await engine.generate(prompt, SamplingParams(**params))
    return [out async for out in stream]


def test_outputs_reach_their_own_streams(stub):
    _, engine = stub

    async def run():
        return await asyncio.gather(*(_collect(engine, [10 * i], max_tokens=3 + i) for i in range(8)))

    for i, outs in enumerate(asyncio.run(run())):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].token_ids == [10 * i + k for k in range(1, 4 + i)]


def test_a_bad_request_fails_alone(stub):
    _, engine = stub

    async def run():
        return await asyncio.gather(_collect(engine, [13, 1], max_tokens=2), _collect(engine, [5], max_tokens=2),
                                    return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, ValueError) and "unlucky" in str(bad)
    assert good[-1].outputs[0].token_ids == [6, 7]
    assert engine.is_healthy


def test_prompt_checks_happen_before_submission(stub):
    _, engine = stub
    for prompt, params in [([], {}), ([1] * 1000, {}), ([1] * 10, {"max_tokens": 991}), ([100], {})]:
        with pytest.raises(RequestRejected):
            asyncio.run(engine.generate(prompt, SamplingParams(**params)))


def test_leaving_a_stream_aborts_its_request():
    llm = StubLLM(step_delay=0.002)
    engine = AsyncLLM(llm)

    async def run():
        stream = await engine.generate([1], SamplingParams(max_tokens=None))
        async for _ in stream:
            break  # a consumer that stops reading
        await stream.aclose()

        async def read_forever():
            stream = await engine.generate([2], SamplingParams(max_tokens=None))
            async for _ in stream:
                pass

        task = asyncio.ensure_future(read_forever())
        await asyncio.sleep(0.05)
        task.cancel()  # what the server sees when a client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(run())
        wait_until(lambda: engine.stats.num_aborted_reqs == 2 and engine.stats.num_free_blocks == NUM_BLOCKS)
        assert not llm.requests
    finally:
        engine.shutdown()


def test_a_failing_step_stops_the_engine_visibly():
    llm = StubLLM(step_delay=0.002)
    engine = AsyncLLM(llm)
    with ServerThread(engine, served_model_names="stub") as server:
        async def run():
            stream = await engine.generate([1], SamplingParams(max_tokens=None))
            await stream.__anext__()
            llm.fail_step = True
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await engine.generate([1], SamplingParams())

        asyncio.run(run())
        assert not engine.is_healthy
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r = httpx.post(server.url + "/v1/completions", json={"model": "stub", "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_shutdown_ends_open_streams(stub):
    _, engine = stub

    async def run():
        stream = await engine.generate([1], SamplingParams(max_tokens=None))
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(run())
    assert not engine.is_healthy


def test_a_reader_that_falls_behind_gets_the_backlog_as_one_output():
    """The real engine (demo model): a stream read only after its request finished yields the
    whole backlog merged, and the merged outputs say exactly what the offline API says."""
    from tests.server_harness import make_llm

    llm = make_llm()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = "The quick brown fox"
    want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    engine = AsyncLLM(llm)
    try:
        async def run():
            stream = await engine.generate(prompt, params)
            while stream._queue.qsize() == 0:  # the request is running
                await asyncio.sleep(0.01)
            deadline = time.monotonic() + 60
            while engine.stats.num_running_reqs or engine.stats.num_waiting_reqs:
                assert time.monotonic() < deadline, "the request did not finish"
                await asyncio.sleep(0.01)
            return [out async for out in stream]

        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(outs) < len(want.token_ids)  # merged: not one output per token
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == want.token_ids
    assert "".join(o.delta_text for o in outs) == want.text == outs[-1].outputs[0].text
