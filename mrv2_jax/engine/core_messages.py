"""The wire format between the API server process and the engine-core process (msgpack, msgspec).

Into the engine (one socket per API server process): `AddRequest` (already tokenized and
validated), `AbortRequests`, `FinishRequests` (stop strings, found by the API process's
detokenizer) and `Shutdown`.
Out of the engine (one socket per API server process): `Ready` or `StartupFailed` once, then one
`StepOutputs` per engine step (the new tokens of that process's requests, its adds that failed, and
the engine's counters), and `EngineFailed` if a step raises. With `stream_in_call`, a second socket
per API server process carries `StreamedTokens` from inside fused calls, one per decode step: the
same tokens arrive again in the call's `StepOutputs`, and the API process keeps whichever comes
first. `EngineDied` comes from the API
process that owns the engine, to the other API processes, when the engine process has exited.
Logprob rows travel as `[token_ids, logprobs, ranks]` lists.
"""

from __future__ import annotations

import msgspec

from mrv2_jax.engine.scheduler_output import EngineCoreOutput
from mrv2_jax.runner.token_logprobs import LogprobRow, TokenLogprobs
from mrv2_jax.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    streaming: bool  # the scheduler caps fused decode by the stream interval while it runs
    client_index: int = 0  # which API server process sent it (and gets its outputs)


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class CoreStats(msgspec.Struct, array_like=True):
    """The engine's counters after a step or a command (the API process's /metrics and /health)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_fused_calls: int = 0
    spec_decode: dict | None = None  # SpecDecodeStats' fields
    num_programs_pending: int = 0


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """What the API process needs to check, tokenize and detokenize requests for this engine."""

    pid: int
    tokenizer_path: str | None
    max_model_len: int
    vocab_size: int
    num_eos: int
    supports_prompt_logprobs: bool
    stats: CoreStats
    # Structured outputs: the EOS ids (the automata end on them) and the runner's automaton pool
    # ((0, 0): constraints are refused), so the API process compiles and checks constraints first.
    eos_token_ids: list[int] = []
    automaton_capacity: tuple[int, int] = (0, 0)
    startup: dict | None = None  # the engine's StartupReport.as_dict(): logged by the API process


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    error: str  # "ExceptionType: message"
    traceback: str


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: list[EngineCoreOutput]
    errors: list[tuple[str, str]]  # (request_id, why its add failed)
    stats: CoreStats
    prefill_tokens: int = 0  # prompt tokens the step computed beside its decode rows
    # The step handed to the runner in the same loop iteration: host seconds of the hand-over
    # (-1: none) and its prompt tokens (EngineCore.dispatched).
    dispatch_s: float = -1.0
    dispatch_prefill_tokens: int = 0
    # When the engine process built this message (time.monotonic, one clock for every process of the
    # host), and the seconds since its previous step's message (-1: none, or the engine was idle between).
    sent_at: float = -1.0
    since_step_s: float = -1.0
    # The engine thread's CPU seconds in that hand-over (-1: none): its seconds minus these were spent
    # waiting (for a CPU, a page, a lock), not working.
    dispatch_cpu_s: float = -1.0
    # Of its seconds, those inside the runner's compiled step calls (-1: none): the rest was the runner's Python.
    dispatch_call_s: float = -1.0


class StreamedTokens(msgspec.Struct, tag="tokens", array_like=True):
    entries: list[tuple[str, int, int]]  # (request_id, index among its outputs, token id)


class EngineFailed(msgspec.Struct, tag="engine_failed", array_like=True):
    error: str
    traceback: str


class EngineDied(msgspec.Struct, tag="engine_died", array_like=True):
    exitcode: int | None


ToEngine = AddRequest | AbortRequests | FinishRequests | Shutdown
FromEngine = Ready | StartupFailed | StepOutputs | StreamedTokens | EngineFailed | EngineDied


def _enc_hook(obj):
    if isinstance(obj, (LogprobRow, TokenLogprobs)):
        return [obj.token_ids, obj.logprobs, obj.ranks]
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the engine's peer")


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def to_engine_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToEngine)


def from_engine_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromEngine)


def logprob_rows(entries: list | None) -> list[TokenLogprobs] | None:
    """Logprob rows as they arrive (`[token_ids, logprobs, ranks]` lists) -> `TokenLogprobs`."""
    return None if entries is None else [TokenLogprobs(*entry) for entry in entries]
