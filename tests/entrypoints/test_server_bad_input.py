"""Hostile and broken requests: every one gets a 4xx with OpenAI's error body, none a 5xx, and
the server keeps serving. Runs with an API key, which is also under test here."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_harness import MODEL_NAME, assert_openai_error, make_llm, running_server, wait_until

API_KEY = "test-key-7f3a"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 64 * 1024
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL_NAME, "prompt": "The king said", "max_tokens": 4, "temperature": 0.0}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
LONG_TEXT = "the king " * 400  # far more than the 256-token context


def comp(**changes):
    return {k: v for k, v in (OK | changes).items() if v is not ...}


def chat(**changes):
    return {k: v for k, v in (OK_CHAT | changes).items() if v is not ...}


# (path, body: dict = JSON, bytes = raw, expected status)
BAD_REQUESTS = {
    # --- not JSON / not an object
    "malformed JSON": (COMPLETIONS, b'{"model": "demo", "prompt": ', 400),
    "empty body": (COMPLETIONS, b"", 400),
    "JSON array": (COMPLETIONS, b"[1, 2, 3]", 400),
    "JSON string": (COMPLETIONS, b'"hello"', 400),
    "NaN literal": (COMPLETIONS, b'{"model": "demo", "prompt": "x", "temperature": NaN}', 400),
    "1e999 float": (COMPLETIONS, b'{"model": "demo", "prompt": "x", "temperature": 1e999}', 400),
    "deeply nested": (COMPLETIONS, b"[" * 5_000 + b"]" * 5_000, 400),
    "invalid UTF-8": (COMPLETIONS, b'{"model": "demo", "prompt": "\xff\xfe"}', 400),
    "huge integer literal": (COMPLETIONS, b'{"model": "demo", "prompt": "x", "max_tokens": 1%s}' % (b"0" * 5000), 400),
    # --- missing / unknown
    "missing prompt": (COMPLETIONS, comp(prompt=...), 400),
    "missing model": (COMPLETIONS, comp(model=...), 400),
    "unknown model": (COMPLETIONS, comp(model="gpt-5"), 404),
    "model not a string": (COMPLETIONS, comp(model=7), 400),
    # --- prompts
    "prompt is a number": (COMPLETIONS, comp(prompt=42), 400),
    "empty prompt": (COMPLETIONS, comp(prompt=""), 400),
    "empty token list": (COMPLETIONS, comp(prompt=[]), 400),
    "negative token id": (COMPLETIONS, comp(prompt=[5, -1]), 400),
    "token id past vocab": (COMPLETIONS, comp(prompt=[5, 10**6]), 400),
    "token id overflows int64": (COMPLETIONS, comp(prompt=[2**70]), 400),
    "mixed token list": (COMPLETIONS, comp(prompt=[5, "x"]), 400),
    "batched prompts": (COMPLETIONS, comp(prompt=["a", "b"]), 400),
    "prompt longer than context": (COMPLETIONS, comp(prompt=LONG_TEXT), 400),
    "max_tokens past context": (COMPLETIONS, comp(max_tokens=300), 400),
    # --- numbers of the wrong type or out of range
    "negative max_tokens": (COMPLETIONS, comp(max_tokens=-5), 400),
    "zero max_tokens": (COMPLETIONS, comp(max_tokens=0), 400),
    "max_tokens as string": (COMPLETIONS, comp(max_tokens="10"), 400),
    "max_tokens as float": (COMPLETIONS, comp(max_tokens=1.5), 400),
    "max_tokens as bool": (COMPLETIONS, comp(max_tokens=True), 400),
    "negative temperature": (COMPLETIONS, comp(temperature=-1), 400),
    "temperature as string": (COMPLETIONS, comp(temperature="hot"), 400),
    "top_p zero": (COMPLETIONS, comp(top_p=0), 400),
    "top_p above 1": (COMPLETIONS, comp(top_p=1.5), 400),
    "top_k below -1": (COMPLETIONS, comp(top_k=-2), 400),
    "min_p above 1": (COMPLETIONS, comp(min_p=2.0), 400),
    "presence_penalty 3": (COMPLETIONS, comp(presence_penalty=3), 400),
    "frequency_penalty -5": (COMPLETIONS, comp(frequency_penalty=-5), 400),
    "repetition_penalty 0": (COMPLETIONS, comp(repetition_penalty=0), 400),
    "seed past 64 bits": (COMPLETIONS, comp(seed=2**70), 400),
    "seed as string": (COMPLETIONS, comp(seed="abc"), 400),
    "min_tokens above max_tokens": (COMPLETIONS, comp(min_tokens=10, max_tokens=4), 400),
    "ignore_eos as string": (COMPLETIONS, comp(ignore_eos="true"), 400),
    # --- stops, biases, logprobs
    "stop is a number": (COMPLETIONS, comp(stop=5), 400),
    "empty stop string": (COMPLETIONS, comp(stop=[""]), 400),
    "stop list of ints": (COMPLETIONS, comp(stop=[1, 2]), 400),
    "stop_token_ids negative": (COMPLETIONS, comp(stop_token_ids=[-1]), 400),
    "stop_token_ids past vocab": (COMPLETIONS, comp(stop_token_ids=[10**6]), 400),
    "logit_bias key not an id": (COMPLETIONS, comp(logit_bias={"abc": 1}), 400),
    "logit_bias negative key": (COMPLETIONS, comp(logit_bias={"-1": 1}), 400),
    "logit_bias key past vocab": (COMPLETIONS, comp(logit_bias={"99999": 1}), 400),
    "logit_bias value 1000": (COMPLETIONS, comp(logit_bias={"5": 1000}), 400),
    "logit_bias is a list": (COMPLETIONS, comp(logit_bias=[1, 2]), 400),
    "logprobs 21": (COMPLETIONS, comp(logprobs=21), 400),
    "logprobs negative": (COMPLETIONS, comp(logprobs=-1), 400),
    "logprobs as bool on completions": (COMPLETIONS, comp(logprobs=True), 400),
    # --- unsupported
    "n=2": (COMPLETIONS, comp(n=2), 400),
    "n=0": (COMPLETIONS, comp(n=0), 400),
    "echo": (COMPLETIONS, comp(echo=True), 400),
    "best_of 3": (COMPLETIONS, comp(best_of=3), 400),
    "stream as string": (COMPLETIONS, comp(stream="yes"), 400),
    "stream_options without stream": (COMPLETIONS, comp(stream_options={"include_usage": True}), 400),
    # --- chat
    "chat: empty messages": (CHAT, chat(messages=[]), 400),
    "chat: missing messages": (CHAT, chat(messages=...), 400),
    "chat: messages not a list": (CHAT, chat(messages="hello"), 400),
    "chat: message not an object": (CHAT, chat(messages=["hello"]), 400),
    "chat: unknown role": (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400),
    "chat: missing role": (CHAT, chat(messages=[{"content": "hi"}]), 400),
    "chat: content is a number": (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400),
    "chat: null content": (CHAT, chat(messages=[{"role": "user", "content": None}]), 400),
    "chat: image part": (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400),
    "chat: too long": (CHAT, chat(messages=[{"role": "user", "content": LONG_TEXT}]), 400),
    "chat: negative max_completion_tokens": (CHAT, chat(max_completion_tokens=-1), 400),
    "chat: top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), 400),
    "chat: top_logprobs 50": (CHAT, chat(logprobs=True, top_logprobs=50), 400),
    "chat: logprobs as int": (CHAT, chat(logprobs=3), 400),
    "chat: n=2": (CHAT, chat(n=2), 400),
    "chat: tools": (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    "chat: unknown response_format": (CHAT, chat(response_format={"type": "yaml"}), 400),
    "chat: json_schema without schema": (CHAT, chat(response_format={"type": "json_schema", "json_schema": {}}), 400),
    "invalid regex": (COMPLETIONS, comp(structured_outputs={"regex": "(ab"}), 400),
    "unsatisfiable regex": (COMPLETIONS, comp(structured_outputs={"regex": r"[^\s\S]"}), 400),
    "empty choice": (COMPLETIONS, comp(structured_outputs={"choice": []}), 400),
    "two constraint kinds": (COMPLETIONS, comp(structured_outputs={"regex": "a", "choice": ["a"]}), 400),
    "invalid schema": (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": 5}}}), 400),
    "invalid grammar": (COMPLETIONS, comp(structured_outputs={"grammar": "start: ("}), 400),
    "unsatisfiable grammar": (COMPLETIONS, comp(structured_outputs={"grammar": 'start: <[0]> "a"'}), 400),
    "constraint given twice": (CHAT, chat(response_format={"type": "json_object"},
                                          structured_outputs={"regex": "a"}), 400),
    "chat: unknown model": (CHAT, chat(model="nope"), 404),
}


@pytest.fixture(scope="module")
def server():
    with running_server(make_llm(), api_key=API_KEY, max_body_bytes=MAX_BODY) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def _post(http, path, body):
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    return http.post(path, json=body)


def test_table_is_large_enough():
    assert len(BAD_REQUESTS) >= 30


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_gets_openai_error(http, case):
    path, body, status = BAD_REQUESTS[case]
    error = assert_openai_error(_post(http, path, body), status)
    if "n=" in case:
        assert "not supported" in error["message"]


def test_param_names_the_offending_field(http):
    assert assert_openai_error(_post(http, COMPLETIONS, comp(temperature=-1)))["param"] == "temperature"
    assert assert_openai_error(_post(http, COMPLETIONS, comp(prompt=LONG_TEXT)))["code"] == "context_length_exceeded"
    assert assert_openai_error(_post(http, COMPLETIONS, comp(max_tokens=300)))["param"] == "max_tokens"
    assert assert_openai_error(_post(http, CHAT, chat(messages=[])))["param"] == "messages"
    assert assert_openai_error(_post(http, COMPLETIONS, comp(model="x")))["code"] == "model_not_found"
    for body, param in ((comp(structured_outputs={"regex": "(ab"}), "structured_outputs"),
                        (comp(structured_outputs={"regex": r"[^\s\S]"}), "structured_outputs"),
                        (comp(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}),
                         "response_format")):
        error = assert_openai_error(_post(http, COMPLETIONS, body))
        assert error["param"] == param and "structured_outputs." in error["message"], error
    for grammar in ("start: (", 'start: <[0]> "a"'):  # invalid; valid but unsatisfiable
        error = assert_openai_error(_post(http, COMPLETIONS, comp(structured_outputs={"grammar": grammar})))
        assert error["param"] == "structured_outputs", error
        assert error["message"].startswith("structured_outputs.grammar: "), error


def test_oversized_body_is_413(http):
    huge = json.dumps(comp(prompt="x" * (MAX_BODY + 10))).encode()
    assert_openai_error(_post(http, COMPLETIONS, huge), 413)

    def chunked():  # no Content-Length: the limit must hold while reading
        for _ in range(MAX_BODY // 1024 + 8):
            yield b" " * 1024

    assert_openai_error(http.post(COMPLETIONS, content=chunked()), 413)


def test_wrong_method_and_path(http):
    assert_openai_error(http.get(COMPLETIONS), 405)
    assert_openai_error(http.get("/v1/nothing-here"), 404)


PROTECTED = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", COMPLETIONS), ("POST", CHAT),
             ("GET", "/v1/nothing-here")]


BAD_KEYS = {"none": {}, "wrong": {"Authorization": "Bearer wrong"}, "no-scheme": {"Authorization": API_KEY},
            "basic": {"Authorization": f"Basic {API_KEY}"}}


@pytest.mark.parametrize("headers", list(BAD_KEYS.values()), ids=list(BAD_KEYS))
def test_api_key_required(server, headers):
    for method, path in PROTECTED:
        r = httpx.request(method, server.url + path, headers=headers, json=OK if method == "POST" else None)
        assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200  # open: probes carry no key


# Fuzzing: arbitrary JSON values in the sampling fields. Whatever comes, the answer is a 200
# or a 4xx in the OpenAI shape, never a 5xx.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
small_valid = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
               "max_tokens": st.integers(1, 3), "seed": st.integers(-(2**63), 2**64 - 1),
               "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
               "logit_bias": st.dictionaries(st.integers(0, 2047).map(str), st.floats(-100, 100), max_size=3),
               "prompt": st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 2047), min_size=1, max_size=8)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(sorted(small_valid)), data=st.data())
def test_fuzzed_fields_never_5xx(http, field, data):
    value = data.draw(small_valid[field] | json_values, label=field)
    body = comp(**{field: value})
    if field != "max_tokens":
        body["max_tokens"] = 2
    r = _post(http, COMPLETIONS, body)
    if r.status_code != 200:
        assert_openai_error(r)


def test_still_serves_after_all_that(server, http):
    assert http.get("/health").json() == {"status": "ok", "api_server": 0}
    r = _post(http, COMPLETIONS, OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = _post(http, CHAT, OK_CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert server.engine.is_healthy
    wait_until(lambda: server.engine.stats.num_free_blocks == server.engine.stats.num_blocks,
               what="every KV block to be free")
