"""The OpenAI-compatible server against the offline API, over real HTTP on 127.0.0.1.

The reference for every output is `LLM.generate` with the same sampling parameters, run
before the server starts (on the same engine object, which the server then takes over, so
both sides see the very same weights). Clients: the official `openai` package, and raw
httpx where the wire format itself is under test (SSE framing, 64 concurrent streams,
disconnects).
"""

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mrv2_jax.bench.serve_compare import STEP_DISPATCH, STEP_INTERVAL
from mrv2_jax.bench.server_histograms import count, scrape
from mrv2_jax.sampling_params import SamplingParams
from tests.server_harness import MODEL_NAME, make_llm, running_server, stream_completion, wait_until

PROMPTS = ["The king said", "Once upon a time, in a far country,", "To be, or not to be:"]
GREEDY = dict(max_tokens=12, temperature=0.0)
SEEDED = dict(max_tokens=12, temperature=1.0, seed=1234)
MODES = {"greedy": GREEDY, "seeded": SEEDED}
CHATS = [
    [{"role": "user", "content": "Hello, who are you?"}],
    [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Tell me of the sea."}],
]
STOP = dict(max_tokens=24, temperature=0.0, stop=["\n"])
BIG_SEED = dict(max_tokens=12, temperature=1.0, seed=2**63 - 5)  # OpenAI seeds are 64-bit
# A stop string that never shows holds back its length - 1 characters: here all of a short output.
HELD_BACK = dict(max_tokens=16, temperature=0.0, stop=["~" * 300])

NAMES = ["The king", "A soldier", "The queen", "My lord", "Romeo", "Juliet", "The duke", "A servant"]
VERBS = ["said", "cried", "asked", "whispered", "answered", "wept", "swore", "laughed"]
CONCURRENT = [f"{n} {v}" for n in NAMES for v in VERBS]  # 64 prompts
CONCURRENT_PARAMS = [dict(max_tokens=10, temperature=1.0, seed=i) for i in range(len(CONCURRENT))]


def _texts(llm, prompts, kwargs):
    params = [SamplingParams(**k) for k in kwargs] if isinstance(kwargs, list) else SamplingParams(**kwargs)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm():
    return make_llm()


@pytest.fixture(scope="module")
def reference(llm):
    """Offline outputs, computed before the server takes the engine over."""
    tok = llm.tokenizer
    chat_prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in CHATS]
    return {
        "completion": {mode: _texts(llm, PROMPTS, kw) for mode, kw in MODES.items()},
        "chat": {mode: _texts(llm, chat_prompts, kw) for mode, kw in MODES.items()},
        "token_ids": _texts(llm, [tok.encode(PROMPTS[0])], GREEDY)[0],
        "stop": _texts(llm, PROMPTS, STOP),
        "big_seed": _texts(llm, PROMPTS[:1], BIG_SEED)[0],
        "held_back": _texts(llm, PROMPTS[:1], HELD_BACK)[0],
        "concurrent": _texts(llm, CONCURRENT, CONCURRENT_PARAMS),
    }


@pytest.fixture(scope="module")
def server(llm, reference):
    with running_server(llm) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "api_server": 0}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


@pytest.mark.parametrize("mode", MODES)
def test_completions_match_offline(client, reference, mode):
    for prompt, expected in zip(PROMPTS, reference["completion"][mode]):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, **MODES[mode])
        assert out.choices[0].text == expected
        assert out.choices[0].finish_reason in ("stop", "length")
        assert out.usage.completion_tokens <= 12 and out.usage.prompt_tokens > 0
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


@pytest.mark.parametrize("mode", MODES)
def test_streamed_completions_match_offline(client, reference, mode):
    for prompt, expected in zip(PROMPTS, reference["completion"][mode]):
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True,
                                                stream_options={"include_usage": True}, **MODES[mode]))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == expected
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finishes) == 1
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0  # include_usage


def test_tokens_whose_text_is_held_back_still_get_their_chunks(client, reference):
    """As from vLLM, each output that brings tokens is a chunk, also when their text is held back (it
    may start a stop string, or end in half a character): a client sees every step, and the text
    comes whole at the end. Before, such tokens sent nothing and the next chunk carried them."""
    text = reference["held_back"]
    assert 0 < len(text) < 299  # all of it held back until the request ends
    chunks = [c for c in client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], stream=True, **HELD_BACK)]
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[0].choices[0].text == "" and chunks[-1].choices[0].text == text
    assert len(chunks) >= 3  # 16 tokens, so more than the first and the last output (steps seldom merge)
    chat = list(client.chat.completions.create(model=MODEL_NAME, messages=CHATS[0], stream=True, **HELD_BACK))
    assert chat[0].choices[0].delta.role == "assistant" and len(chat) >= 4
    assert all(c.choices[0].delta.content == "" for c in chat[:-1]) and chat[-1].choices[0].delta.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", MODES)
def test_chat_matches_offline(client, reference, mode, stream):
    for messages, expected in zip(CHATS, reference["chat"][mode]):
        out = client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=stream, **MODES[mode])
        if stream:
            chunks = list(out)
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            assert out.choices[0].message.role == "assistant"
            text = out.choices[0].message.content
        assert text == expected


def test_token_id_prompt_stop_strings_and_64_bit_seeds(client, llm, reference):
    ids = llm.tokenizer.encode(PROMPTS[0])
    out = client.completions.create(model=MODEL_NAME, prompt=ids, **GREEDY)
    assert out.choices[0].text == reference["token_ids"]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **BIG_SEED)
    assert out.choices[0].text == reference["big_seed"]
    for prompt, expected in zip(PROMPTS, reference["stop"]):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, **STOP)
        assert out.choices[0].text == expected and "\n" not in expected


def test_logprob_requests_are_accepted(client):
    """Accepted and validated now; filled once the sampler returns logprobs."""
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    if lp is not None:
        assert len(lp.tokens) == out.usage.completion_tokens
        assert all(len(top) >= 1 for top in lp.top_logprobs)
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHATS[0], logprobs=True, top_logprobs=2,
                                         **GREEDY)
    lp = out.choices[0].logprobs
    if lp is not None:
        assert len(lp.content) == out.usage.completion_tokens
        assert all(len(t.top_logprobs) == 2 for t in lp.content)


async def _stream_one(http: httpx.AsyncClient, prompt: str, params: dict) -> tuple[list[dict], str]:
    events = await stream_completion(http, {"prompt": prompt, **params})
    return events, "".join(e["choices"][0]["text"] for e in events)


def test_64_concurrent_streams(server, reference):
    async def run():
        limits = httpx.Limits(max_connections=len(CONCURRENT))
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(_stream_one(http, p, kw) for p, kw in zip(CONCURRENT, CONCURRENT_PARAMS)))

    results = asyncio.run(run())
    ids = set()
    for (events, text), expected in zip(results, reference["concurrent"]):
        stream_ids = {e["id"] for e in events}
        assert len(stream_ids) == 1  # every chunk of a stream belongs to its request
        ids |= stream_ids
        assert text == expected
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len(ids) == len(CONCURRENT)
    # The engine publishes its stats just after handing out a step's outputs: wait for them.
    wait_until(lambda: server.engine.stats.num_free_blocks == server.engine.stats.num_blocks,
               what="every KV block to be free")
    assert server.engine.stats.num_running_reqs == 0


def _all_blocks_free(engine, aborted_before):
    s = engine.stats
    return (s.num_aborted_reqs == aborted_before + 1 and s.num_running_reqs == 0 and s.num_waiting_reqs == 0
            and s.num_free_blocks == s.num_blocks)


LONG = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 220, "temperature": 0.0, "ignore_eos": True}


def test_stream_disconnect_aborts_and_frees_blocks(server):
    engine = server.engine
    aborted = engine.stats.num_aborted_reqs
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data: ")
                if lines == 3:
                    break  # hang up after a few tokens of 220
    wait_until(lambda: _all_blocks_free(engine, aborted), what="the aborted request to free its blocks")


def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    engine = server.engine
    aborted = engine.stats.num_aborted_reqs
    with pytest.raises(httpx.TimeoutException):  # the client gives up long before 220 tokens
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=0.3)
    wait_until(lambda: _all_blocks_free(engine, aborted), what="the aborted request to free its blocks")


def test_metrics(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name != "mrv2_requests_total"}
    for name in ("mrv2_num_requests_running", "mrv2_num_requests_waiting", "mrv2_kv_cache_usage_ratio",
                 "mrv2_prefix_cache_hit_rate", "mrv2_time_per_output_token_seconds_count"):
        assert name in samples, name
    assert samples["mrv2_prompt_tokens_total"] > 0 and samples["mrv2_generation_tokens_total"] >= 12
    assert samples["mrv2_time_to_first_token_seconds_count"] >= 1
    assert samples["mrv2_engine_healthy"] == 1.0


def _histogram_counts(url):
    """{sample name: value} of every histogram's _count and _sum, summed over label sets."""
    counts = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name.endswith(("_count", "_sum")):
                counts[sample.name] = counts.get(sample.name, 0.0) + sample.value
    return counts


def _step_interval_buckets(url):
    return scrape(url, (STEP_INTERVAL, STEP_DISPATCH), by="step")


def test_inter_token_gaps_and_step_intervals_are_counted(server, client):
    """One streamed request alone: the server's inter-token histogram gains one gap per chunk of
    tokens after the first (the client's chunks are the reference: one per token, unless the
    handler fell behind the engine and sent several tokens in one chunk), each gap no longer than the
    client's whole wait; the step-interval histogram gains the intervals between its steps, and the
    dispatch histogram the host time of handing each of its steps to the runner."""
    before, split_before = _histogram_counts(server.url), _step_interval_buckets(server.url)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    # The handler finished its metrics before it sent the usage.
    after, split_after = _histogram_counts(server.url), _step_interval_buckets(server.url)
    tokens = chunks[-1].usage.completion_tokens
    token_chunks = [chunk for chunk in chunks if chunk.choices]  # (the last one carries only the usage)
    gaps = after["mrv2_inter_token_latency_seconds_count"] - before["mrv2_inter_token_latency_seconds_count"]
    assert tokens == GREEDY["max_tokens"] and 1 <= len(token_chunks) <= tokens
    assert gaps == len(token_chunks) - 1
    e2e = after["mrv2_e2e_request_latency_seconds_sum"] - before["mrv2_e2e_request_latency_seconds_sum"]
    assert 0 < after["mrv2_inter_token_latency_seconds_sum"] - before["mrv2_inter_token_latency_seconds_sum"] < e2e
    steps = after["mrv2_step_output_interval_seconds_count"] - before["mrv2_step_output_interval_seconds_count"]
    assert 1 <= steps <= tokens
    # The prompt is computed in one step (the budget holds it), whose outputs end exactly one interval.
    prefill, decode = (f'{STEP_INTERVAL}{{step="{kind}"}}' for kind in ("prefill", "decode"))
    assert count(split_before.get(prefill), split_after[prefill]) == 1
    assert count(split_before.get(decode), split_after[decode]) == steps - 1
    # Its prompt's step was handed to the runner once, then each decode step at most once; the
    # hand-overs took host time, all of it inside the request's wait.
    prefill, decode = (f'{STEP_DISPATCH}{{step="{kind}"}}' for kind in ("prefill", "decode"))
    assert count(split_before.get(prefill), split_after[prefill]) == 1
    assert 1 <= count(split_before.get(decode), split_after[decode]) <= tokens
    assert 0 < after["mrv2_step_dispatch_seconds_sum"] - before.get("mrv2_step_dispatch_seconds_sum", 0.0) < e2e
