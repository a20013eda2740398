"""Shared set-up of the server tests: the demo model on the V2 runner (async) with small limits, and a
real HTTP server on a free port of 127.0.0.1, run in this process on a background thread (so
tests can look at the engine's state directly, e.g. that every KV block is free again)."""

import functools
import json
import os
import signal
import time
from contextlib import contextmanager

import httpx

from mrv2_jax.async_llm import AsyncLLM
from mrv2_jax.entrypoints.openai_server import ServerThread
from mrv2_jax.llm import LLM

MODEL_NAME = "demo"
# Small limits keep the compile at start-up short on a CPU; 256 tokens of context make the
# "too long" cases cheap to build. The servers get greedy and sampled requests together: the widest
# sampler variant alone serves both, one program per bucket instead of two.
ENGINE_ARGS = dict(dtype="float32", runner="v2", max_num_seqs=16, max_num_batched_tokens=32,
                   max_model_len=256, block_size=16, num_gpu_blocks=160, sampler_variants="all", show_progress=False)


def make_llm(**overrides) -> LLM:
    return LLM(MODEL_NAME, **(ENGINE_ARGS | overrides))


@functools.cache
def reference_llm() -> LLM:
    """One offline engine of this configuration per test process, shared by the modules whose
    served outputs are compared with its `generate`. Their requests are greedy or seeded, so what
    ran on it before does not change what it gives."""
    return make_llm()


@contextmanager
def running_server(llm: LLM, **app_kwargs):
    """Serve `llm` (which then belongs to the engine thread) until the block exits."""
    engine = AsyncLLM(llm)
    try:
        with ServerThread(engine, served_model_names=MODEL_NAME, **app_kwargs) as server:
            yield server
    finally:
        engine.shutdown()


def wait_until(condition, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def assert_openai_error(response, status: int | None = None):
    """A 4xx with OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if status is not None:
        assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    assert isinstance(body["error"]["type"], str), body
    return body["error"]


async def stream_completion(http, body: dict) -> list[dict]:
    """POST a streaming /v1/completions request (an httpx.AsyncClient) -> its server-sent event
    payloads, checking the SSE framing: only `data:` lines, nothing after `[DONE]`, which ends it."""
    events, done = [], False
    async with http.stream("POST", "/v1/completions", json={"model": MODEL_NAME, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done, line  # nothing after [DONE]
            if line == "data: [DONE]":
                done = True
            else:
                events.append(json.loads(line[len("data: "):]))
    assert done
    return events


def error_event_after_kill(url: str, body: dict, pid: int) -> dict:
    """Open a streaming /v1/completions request, SIGKILL `pid` after its first event, read the
    stream to its end (it must end, not hang, with [DONE]) and return its error event's error."""
    events = []
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"model": MODEL_NAME, "stream": True, **body}) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            os.kill(pid, signal.SIGKILL)
            events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", events[-3:]
    return json.loads(events[-2][len("data: "):])["error"]


def stream_all(url: str, bodies: list[dict]) -> list[list[dict]]:
    """Stream every body at once, one connection each -> each stream's event payloads, in order."""
    import asyncio

    async def run():
        limits = httpx.Limits(max_connections=len(bodies))
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(stream_completion(http, body) for body in bodies))

    return asyncio.run(run())
