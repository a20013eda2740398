"""Request schemas of the OpenAI-compatible API, and their mapping to `SamplingParams`.

The schemas are strict: a field with the wrong JSON type is an error, never coerced ("10"
is not a number, 1.0 is not an integer, 1 is not a boolean, NaN is not a float). Unknown
fields are ignored, so clients that send OpenAI parameters we do not use still work -- but
parameters whose silent omission would change the result (n > 1, echo, tools, grammars, ...)
are refused with a message saying they are not supported.

Structured outputs: OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's
`structured_outputs` extra field (`json`, `json_object`, `regex`, `choice`) on both endpoints
become `SamplingParams.structured_outputs`; a bad constraint is a 400 naming the field.

Ranges are checked here rather than left to the engine because a value that reached the
engine's int32 tables out of range would fail inside a step; every integer is therefore
bounded (to int32, or 64 bits for the seed), and token ids to the vocabulary (which needs the
model: `to_sampling_params`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mrv2_jax.entrypoints.openai_errors import OpenAIError, bad_request, from_value_error
from mrv2_jax.sampling_params import MAX_LOGPROBS, SamplingParams

INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Bias = Annotated[float, Field(ge=-100, le=100)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _GenerationRequest(_Strict):
    """The fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    # Any 64-bit seed, as OpenAI's API allows; the sampler folds it into its int32 tables.
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0, le=INT32_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    logit_bias: dict[str, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    user: str | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if isinstance(v, list):
            if len(v) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
            if any(not s for s in v):
                raise ValueError("stop strings must not be empty")
        elif v == "":
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        if v is not None:
            for key in v:
                if not key.isascii() or not key.isdigit() or len(key) > 10:
                    raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        return v

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v):
        if v is not None and v != 1:
            raise ValueError(f"n must be 1: generating several choices per request (n > 1) is not "
                             f"supported, got {v}")
        return v

    # --- mapping ------------------------------------------------------------------------------
    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check(self, vocab_size: int) -> None:
        """Checks that span fields or need the model; raises OpenAIError (400)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        for t in self.stop_token_ids or ():
            if t >= vocab_size:
                raise bad_request(f"stop_token_ids: token id {t} is out of range [0, {vocab_size})",
                                  param="stop_token_ids")
        for key in self.logit_bias or {}:
            if int(key) >= vocab_size:
                raise bad_request(f"logit_bias: token id {key} is out of range [0, {vocab_size})",
                                  param="logit_bias")

    @property
    def constraint_field(self) -> str:
        """The request field a structured-output constraint came from (errors name it)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def _structured(self) -> dict | None:
        """The constraint as StructuredOutputsParams fields, or None; 400 on a malformed field."""
        rf = self.response_format
        from_format = None
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                from_format = {"json_object": True}
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                                      param="response_format")
                from_format = {"json": schema}
            elif kind != "text":
                raise OpenAIError(400, f"response_format {kind!r} is not supported by this server (text, "
                                  "json_object, json_schema)", param="response_format", code="unsupported")
        if self.structured_outputs is None:
            return from_format
        if from_format is not None:
            raise bad_request("give either response_format or structured_outputs, not both",
                              param="structured_outputs")
        return self.structured_outputs

    def _sampling_kwargs(self) -> dict:
        def given(value, default):
            return default if value is None else value

        return dict(
            temperature=given(self.temperature, 1.0), top_p=given(self.top_p, 1.0), top_k=given(self.top_k, 0),
            min_p=given(self.min_p, 0.0), seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=given(self.ignore_eos, False), min_tokens=given(self.min_tokens, 0),
            presence_penalty=given(self.presence_penalty, 0.0),
            frequency_penalty=given(self.frequency_penalty, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            include_stop_str_in_output=given(self.include_stop_str_in_output, False),
            skip_special_tokens=given(self.skip_special_tokens, True), structured_outputs=self._structured())

    def _build(self, vocab_size: int, **kwargs) -> SamplingParams:
        self.check(vocab_size)
        try:
            return SamplingParams(**(self._sampling_kwargs() | kwargs))
        except ValueError as e:  # second line of defence: SamplingParams' own checks
            if str(e).startswith("structured_outputs"):
                raise bad_request(str(e), param=self.constraint_field) from e
            raise from_value_error(e, set(type(self).model_fields)) from e


def _refuse(value: Any, param: str, what: str) -> None:
    if value:
        raise OpenAIError(400, f"{what} is not supported by this server", param=param, code="unsupported")


class CompletionRequest(_GenerationRequest):
    prompt: str | list[TokenId]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)  # OpenAI's default; null = up to the context
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        # The API allows a batch of prompts; a batch of one is the same as its prompt.
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            v = v[0]
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("the prompt must not be empty")
        return v

    def to_sampling_params(self, vocab_size: int) -> SamplingParams:
        _refuse(self.echo, "echo", "echo")
        _refuse(self.best_of is not None and self.best_of != 1, "best_of", "best_of > 1")
        _refuse(self.suffix, "suffix", "suffix")
        return self._build(vocab_size, max_tokens=self.max_tokens, logprobs=self.logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)  # deprecated name of the next
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = True
    tools: list | None = None
    functions: list | None = None
    tool_choice: Any = None

    def to_sampling_params(self, vocab_size: int) -> SamplingParams:
        _refuse(self.tools, "tools", "tool calling")
        _refuse(self.functions, "functions", "function calling")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._build(vocab_size, max_tokens=max_tokens, logprobs=logprobs)

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]
