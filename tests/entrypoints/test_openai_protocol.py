"""The request -> SamplingParams mapping and the logprob formats, without a server."""

import math
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from mrv2_jax.engine.output import CompletionOutput, RequestMetrics, RequestOutput
from mrv2_jax.entrypoints import openai_responses as R
from mrv2_jax.entrypoints.openai_errors import OpenAIError
from mrv2_jax.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest

VOCAB = 100


def test_every_completion_field_reaches_sampling_params():
    req = CompletionRequest.model_validate(dict(
        model="m", prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3,
        stop=["a", "b"], stop_token_ids=[4], ignore_eos=True, min_tokens=2, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={"7": 5.0}, logprobs=3,
        include_stop_str_in_output=True, skip_special_tokens=False, user="someone", unknown_field=1))
    p = req.to_sampling_params(VOCAB)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (7, 0.5, 0.9, 5, 0.1, 3)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens) == (["a", "b"], [4], True, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logit_bias == {7: 5.0} and p.logprobs == 3
    assert p.include_stop_str_in_output and not p.skip_special_tokens


def test_completion_defaults_follow_openai():
    p = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).to_sampling_params(VOCAB)
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.logprobs is None and p.stop == []
    one = CompletionRequest.model_validate({"model": "m", "prompt": ["only one"]})
    assert one.prompt == "only one"  # a batch of one is its prompt


def test_chat_mapping():
    req = ChatCompletionRequest.model_validate(dict(
        model="m", max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=4,
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]))
    p = req.to_sampling_params(VOCAB)
    assert p.max_tokens == 9 and p.logprobs == 4  # max_completion_tokens wins over the old name
    assert req.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    p = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]}
                                             ).to_sampling_params(VOCAB)
    assert p.max_tokens is None and p.logprobs is None  # up to the context; no logprobs


def test_an_int_is_a_valid_float():  # JSON has one number type
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": 1}).temperature == 1.0


@pytest.mark.parametrize("body", [{"max_tokens": 2.0}, {"max_tokens": "2"}, {"seed": True}, {"prompt": [1, True]},
                                  {"stream": 1}, {"stop": 5}])
def test_no_type_coercion(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x"} | body)


def test_vocab_checks_need_the_model():
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logit_bias": {"150": 1}})
    with pytest.raises(OpenAIError) as e:
        req.to_sampling_params(VOCAB)
    assert e.value.status == 400 and e.value.param == "logit_bias"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json"),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
    ({"structured_outputs": {"json": SCHEMA}}, "json")])
def test_constraints_reach_sampling_params(fields, kind):
    for req in (CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields}),
                ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                      **fields})):
        so = req.to_sampling_params(VOCAB).structured_outputs
        assert (so and so.kind) == kind


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs")])
def test_bad_constraints_are_400_naming_the_field(fields, param):
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})
    with pytest.raises(OpenAIError) as e:
        req.to_sampling_params(VOCAB)
    assert e.value.status == 400 and e.value.param == param


@dataclass
class Logprob:  # the shape the sampler fills in (engine/output.py)
    logprob: float
    rank: int
    decoded_token: str | None = None


def _output(token_ids, logprobs, finished=False):
    return RequestOutput("r", None, [1, 2], [CompletionOutput("", token_ids, "length" if finished else None,
                                                               logprobs=logprobs)], finished, RequestMetrics(0.0))


ENTRIES = [
    {5: Logprob(-0.1, 1, "He"), 6: Logprob(-2.5, 2, "We")},
    {9: Logprob(-3.0, 3, "y"), 7: Logprob(-0.2, 1, "llo"), 8: Logprob(-float("inf"), 2, "!")},
]


def test_completion_logprobs_format_across_stream_deltas():
    fmt, tracker = R.LogprobFormatter(None, top_k=2), R.DeltaTracker()
    first = R.completion_logprobs(fmt, _output([5], ENTRIES[:1]), tracker)
    second = R.completion_logprobs(fmt, _output([5, 9], ENTRIES, finished=True), tracker)
    assert first == {"tokens": ["He"], "token_logprobs": [-0.1], "top_logprobs": [{"He": -0.1, "We": -2.5}],
                     "text_offset": [0]}
    # The sampled token (rank 3) is outside the top 2 but still listed; -inf becomes a JSON number.
    assert second == {"tokens": ["y"], "token_logprobs": [-3.0],
                      "top_logprobs": [{"llo": -0.2, "!": R.MIN_LOGPROB, "y": -3.0}], "text_offset": [2]}


def test_chat_logprobs_format():
    body = R.chat_logprobs(R.LogprobFormatter(None, top_k=1), _output([5, 9], ENTRIES), R.DeltaTracker())
    assert body == {"content": [
        {"token": "He", "logprob": -0.1, "bytes": list(b"He"), "top_logprobs": [
            {"token": "He", "logprob": -0.1, "bytes": list(b"He")}]},
        {"token": "y", "logprob": -3.0, "bytes": list(b"y"), "top_logprobs": [
            {"token": "llo", "logprob": -0.2, "bytes": list(b"llo")}]}]}
    assert all(math.isfinite(t["logprob"]) for t in body["content"])


def test_no_logprobs_until_the_sampler_fills_them():
    fmt = R.LogprobFormatter(None, top_k=2)
    assert R.completion_logprobs(fmt, _output([5], None), R.DeltaTracker()) is None
    assert R.chat_logprobs(None, _output([5], ENTRIES[:1]), R.DeltaTracker()) is None
