"""The server with its engine core in a process of its own (the default of `mrv2-jax serve`), over
real HTTP on 127.0.0.1, on the demo model.

The reference for every output is the offline `LLM.generate` (not streamed), computed in this test
process on its own engine with the same weights. One server for the module; the last test kills its
engine process, so it stays last.
"""

import asyncio
import json
import math
import os
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mrv2_jax.async_llm import AsyncLLM
from mrv2_jax.bench.serve_compare import (
    ENGINE_INTERVAL,
    STEP_DELIVERY,
    STEP_DISPATCH,
    STEP_DISPATCH_CALL,
    STEP_DISPATCH_OFF_CPU,
    STEP_INTERVAL,
)
from mrv2_jax.bench.server_histograms import count, scrape
from mrv2_jax.core_client import EngineStartupError
from mrv2_jax.entrypoints.openai_server import ServerThread
from mrv2_jax.gc_heap import ENGINE_GEN0_THRESHOLD
from mrv2_jax.sampling_params import SamplingParams
from tests.server_harness import (
    ENGINE_ARGS,
    MODEL_NAME,
    error_event_after_kill,
    reference_llm,
    stream_all,
    stream_completion,
    wait_until,
)
from tests.structured.grammar_cases import LARK, REGEX

STREAM_INTERVAL = 4  # below the default max_fused_steps (16), so the cap shows
# The CPU's default sampler variants (greedy, all) in the engine process: the greedy programs of the
# buckets that no greedy-only step used stay uncompiled, which /metrics reports (the last test but one).
ENGINE_PROCESS_ARGS = ENGINE_ARGS | dict(stream_interval=STREAM_INTERVAL, sampler_variants=None)

NAMES = ["The king", "A soldier", "The queen", "My lord", "Romeo", "Juliet", "The duke", "A servant"]
VERBS = ["said", "cried", "asked", "whispered", "answered", "wept", "swore", "laughed"]
CONCURRENT = [f"{n} {v}" for n in NAMES for v in VERBS]  # 64 prompts
# Half greedy, half seeded sampling; ignore_eos so every stream runs its whole length.
CONCURRENT_PARAMS = [dict(max_tokens=10, temperature=0.0, ignore_eos=True) if i % 2 else
                     dict(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(CONCURRENT))]
LONG_PROMPT = "Once upon a time, in a far country,"
FUSED = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
STOP = dict(max_tokens=200, temperature=0.0, ignore_eos=True, stop=["books"])  # the API process finds the stop
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "king": {"type": "boolean"}},
          "required": ["name", "king"]}
# Constraints through the wire format: response_format (OpenAI) and structured_outputs (vLLM).
STRUCTURED = {"schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
                         {"json": SCHEMA}),
              "regex": ({"structured_outputs": {"regex": r"[A-Z][a-z]{1,6}( [a-z]{1,6}){1,3}\."}},
                        {"regex": r"[A-Z][a-z]{1,6}( [a-z]{1,6}){1,3}\."}),
              "choice": ({"structured_outputs": {"choice": ["yes", "no", "my lord"]}},
                         {"choice": ["yes", "no", "my lord"]}),
              "grammar": ({"structured_outputs": {"grammar": LARK}}, {"grammar": LARK})}


@pytest.fixture(scope="module")
def engine_and_reference():
    # The reference first, then the engine process: it loads the steps the reference compiled from the
    # persistent cache (started beside it, it compiled the same programs at the same time).
    llm = reference_llm()
    params = [SamplingParams(**kw) for kw in CONCURRENT_PARAMS]
    reference = {
        "concurrent": [o.outputs[0].text for o in llm.generate(CONCURRENT, params, use_tqdm=False)],
        "fused": llm.generate([LONG_PROMPT], SamplingParams(**FUSED), use_tqdm=False)[0].outputs[0].text,
        "stop": llm.generate([LONG_PROMPT], SamplingParams(**STOP), use_tqdm=False)[0].outputs[0].text,
        **{kind: llm.generate([LONG_PROMPT], SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so),
                              use_tqdm=False)[0].outputs[0].text for kind, (_, so) in STRUCTURED.items()}}
    return AsyncLLM.from_engine_args(MODEL_NAME, **ENGINE_PROCESS_ARGS), reference


@pytest.fixture(scope="module")
def reference(engine_and_reference):
    return engine_and_reference[1]


@pytest.fixture(scope="module")
def server(engine_and_reference):
    engine = engine_and_reference[0]
    try:
        with ServerThread(engine, served_model_names=MODEL_NAME) as srv:
            yield srv
    finally:
        engine.shutdown()
    assert not engine._client.process.is_alive()


def _all_blocks_free(engine) -> bool:
    s = engine.stats
    return s.num_running_reqs == 0 and s.num_waiting_reqs == 0 and s.num_free_blocks == s.num_blocks


def _step_counts(url: str, name: str = STEP_INTERVAL) -> dict[str, float]:
    """How many observations the server's histogram `name` holds, by its `step` label."""
    found = scrape(url, (name,), by="step")
    return {kind: count(None, found.get(f'{name}{{step="{kind}"}}', {})) for kind in ("decode", "prefill")}


def _decode_sum(url: str, name: str) -> float:
    """The seconds the server's histogram `name` has summed for decode steps."""
    text = httpx.get(url + "/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) if family.name == name
               for sample in family.samples if sample.name == f"{name}_sum" and sample.labels["step"] == "decode")


def _text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events)


def test_the_engine_runs_in_another_process(server):
    engine = server.engine
    assert engine.engine_pid not in (None, os.getpid())
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "api_server": 0}
    # The engine process froze its start-up heap (modules, model, programs) for the garbage collector,
    # and relaxed generation 0 so that its steps trigger no collection.
    assert engine._client.ready.startup["gc_frozen_objects"] > 10_000
    assert engine._client.ready.startup["gc_thresholds"][0] == ENGINE_GEN0_THRESHOLD


def test_64_concurrent_streams_match_offline(server, reference):
    results = stream_all(server.url, [{"prompt": p, **kw} for p, kw in zip(CONCURRENT, CONCURRENT_PARAMS)])
    assert [_text(events) for events in results] == reference["concurrent"]
    for events in results:
        assert len({e["id"] for e in events}) == 1  # every chunk of a stream belongs to its request
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len({events[0]["id"] for events in results}) == len(CONCURRENT)
    # The engine process's counters arrive with its messages: every block is free again.
    wait_until(lambda: _all_blocks_free(server.engine), what="every KV block to be free")


def test_stream_interval_bounds_chunks_and_non_streaming_keeps_full_k(server, reference):
    engine = server.engine
    steps = engine.stats.num_steps
    intervals, dispatches = _step_counts(server.url), _step_counts(server.url, STEP_DISPATCH)
    engine_intervals, deliveries = _step_counts(server.url, ENGINE_INTERVAL), _step_counts(server.url, STEP_DELIVERY)
    engine_seconds, began = _decode_sum(server.url, ENGINE_INTERVAL), time.monotonic()
    off_cpu_before, calls_before = (_step_counts(server.url, n) for n in (STEP_DISPATCH_OFF_CPU, STEP_DISPATCH_CALL))
    off_cpu_seconds, call_seconds, dispatch_seconds = (
        _decode_sum(server.url, n) for n in (STEP_DISPATCH_OFF_CPU, STEP_DISPATCH_CALL, STEP_DISPATCH))
    # logprobs=0: each chunk lists its tokens, which shows how many tokens it carries.
    events = asyncio.run(_stream_with_client(server, {"prompt": LONG_PROMPT, "logprobs": 0, **FUSED}))
    sizes = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e["choices"][0]["logprobs"]]
    assert _text(events) == reference["fused"] and sum(sizes) == FUSED["max_tokens"]
    wait_until(lambda: _all_blocks_free(engine), what="the streamed request to finish")
    took = time.monotonic() - began
    # Its prompt was computed in one step: the engine process's message says so, and exactly one
    # step interval of the server's histogram ends with a step that computed prompt tokens.
    after = _step_counts(server.url)
    assert after["prefill"] - intervals["prefill"] == 1
    assert after["decode"] - intervals["decode"] >= 1
    # Each step the engine handed to its runner was timed, by the same label: the prompt's one step,
    # then at most one decode hand-over per engine step.
    handed = _step_counts(server.url, STEP_DISPATCH)
    assert handed["prefill"] - dispatches["prefill"] == 1
    assert 1 <= handed["decode"] - dispatches["decode"] <= engine.stats.num_steps - steps
    # Each hand-over's time off the engine thread's CPU came with it, and is a part of it.
    off_cpu = _step_counts(server.url, STEP_DISPATCH_OFF_CPU)
    assert {k: off_cpu[k] - off_cpu_before[k] for k in off_cpu} == {k: handed[k] - dispatches[k] for k in handed}
    assert 0 <= _decode_sum(server.url, STEP_DISPATCH_OFF_CPU) - off_cpu_seconds <= \
        _decode_sum(server.url, STEP_DISPATCH) - dispatch_seconds
    # So did its time inside the runner's compiled calls: every decode hand-over made at least one.
    in_calls = _step_counts(server.url, STEP_DISPATCH_CALL)
    assert {k: in_calls[k] - calls_before[k] for k in in_calls} == {k: handed[k] - dispatches[k] for k in handed}
    assert 0 < _decode_sum(server.url, STEP_DISPATCH_CALL) - call_seconds <= \
        _decode_sum(server.url, STEP_DISPATCH) - dispatch_seconds
    # The engine process stamped each step's message: one delivery per message that brought outputs
    # (a step may bring none: the first one hands the prompt's step over and has nothing to read yet),
    # and for each of them the interval since the engine's previous step message, all within the request.
    delivered = _step_counts(server.url, STEP_DELIVERY)
    decode_deliveries = delivered["decode"] - deliveries["decode"]
    assert delivered["prefill"] - deliveries["prefill"] == 1
    assert 1 <= decode_deliveries <= engine.stats.num_steps - steps - 1
    by_engine = _step_counts(server.url, ENGINE_INTERVAL)
    assert {k: by_engine[k] - engine_intervals[k] for k in by_engine} == {"prefill": 1, "decode": decode_deliveries}
    assert 0 < _decode_sum(server.url, ENGINE_INTERVAL) - engine_seconds < took
    # The engine ran at most STREAM_INTERVAL decode steps per call for it. (Counted in the engine: a
    # reader that falls behind gets two calls' tokens in one chunk, request_stream.py.)
    assert engine.stats.num_steps - steps >= math.ceil((FUSED["max_tokens"] - 1) / STREAM_INTERVAL)

    before, steps = engine.stats.num_fused_calls, engine.stats.num_steps
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": LONG_PROMPT, **FUSED},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference["fused"]
    wait_until(lambda: _all_blocks_free(engine), what="the request to finish")
    calls = engine.stats.num_fused_calls - before
    # Alone and not streaming, the request decodes up to max_fused_steps (16) tokens per call.
    assert 1 <= calls < (FUSED["max_tokens"] - 1) / STREAM_INTERVAL, calls
    assert engine.stats.num_steps - steps < (FUSED["max_tokens"] - 1) / STREAM_INTERVAL


def test_stop_strings_finish_the_request_in_the_engine(server, reference):
    body = {"prompt": LONG_PROMPT, **STOP}
    steps = server.engine.stats.num_steps
    events = asyncio.run(_stream_with_client(server, body))
    assert _text(events) == reference["stop"] and events[-1]["choices"][0]["finish_reason"] == "stop"
    wait_until(lambda: _all_blocks_free(server.engine), what="the stopped request to free its blocks")
    # Finished in the engine when the stop string showed, far before its 200 tokens (50 calls of 4).
    assert server.engine.stats.num_steps - steps < 25
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=60)
    assert r.json()["choices"][0]["text"] == reference["stop"] != "" and "books" not in reference["stop"]
    wait_until(lambda: _all_blocks_free(server.engine), what="the stopped requests to free their blocks")


def test_structured_outputs_through_the_engine_process(server, reference):
    """Each constraint crosses to the engine process and back, streamed and not: the offline
    output, which fits its constraint; a bad one is a 400 naming the field, and nothing else
    changes."""
    for kind, (fields, _) in STRUCTURED.items():
        body = {"prompt": LONG_PROMPT, "max_tokens": 40, "temperature": 0.0, **fields}
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference[kind]
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert _text(asyncio.run(_stream_with_client(server, body))) == reference[kind]
    assert json.loads(reference["schema"]).keys() == {"name", "king"}
    assert reference["choice"] in ("yes", "no", "my lord")
    assert re.fullmatch(REGEX, reference["grammar"])
    for grammar in ("start: (", 'start: <[0]> "a"'):  # checked in the API process, never reaching the engine
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "x", "structured_outputs": {"grammar": grammar}})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("structured_outputs.grammar: ")
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "x", "structured_outputs": {"regex": r"[^\s\S]"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    assert httpx.get(server.url + "/health").status_code == 200
    wait_until(lambda: _all_blocks_free(server.engine), what="the constrained requests to free their blocks")


async def _stream_with_client(server, body):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        return await stream_completion(http, body)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    engine = server.engine
    aborted = engine.stats.num_aborted_reqs
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 220, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data: ")
                if lines == 3:
                    break  # hang up after a few tokens of 220
    wait_until(lambda: engine.stats.num_aborted_reqs == aborted + 1 and _all_blocks_free(engine),
               what="the aborted request to free its blocks in the engine process")
    samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
               for s in f.samples}
    assert samples["mrv2_kv_cache_free_blocks"] == engine.stats.num_blocks
    assert samples["mrv2_num_requests_running"] == 0 and samples["mrv2_engine_healthy"] == 1.0
    assert samples["mrv2_requests_aborted_total"] >= 1
    # Compile mode lazy (the CPU default): the programs this module's requests never used are not compiled.
    assert samples["mrv2_step_programs_pending"] == engine.stats.num_programs_pending > 0


def test_a_killed_engine_process_ends_streams_and_turns_the_server_503(server):
    """Last: it kills the module's engine."""
    engine = server.engine
    body = {"prompt": LONG_PROMPT, "max_tokens": 220, "temperature": 0.0, "ignore_eos": True}
    error = error_event_after_kill(server.url, body, engine.engine_pid)
    assert error["code"] == "engine_dead" and "exit code -9" in error["message"], error
    assert not engine.is_healthy
    r = httpx.get(server.url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "engine_dead"


def test_an_engine_that_cannot_start_says_why():
    with pytest.raises(EngineStartupError, match=r"failed to start \(exit code 1\).*no/such/model"):
        AsyncLLM.from_engine_args("no/such/model", startup_timeout=120)
