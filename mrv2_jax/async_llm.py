"""The engine behind an asyncio-facing API (what the server talks to), in one of two places:

* in its own process (the server's default, `AsyncLLM.from_engine_args`): a `CoreClient`
  (core_client.py) runs the engine core in a process of its own; this process keeps
  tokenizing, detokenizing and stop strings (an `OutputProcessor`), and one thread here reads
  the engine's per-step messages and hands the outputs to the streams. Other API server
  processes reach the same engine with an `AttachedCoreClient` (`--api-server-count`);
* on a thread of this process (`AsyncLLM(llm)`, `--engine-in-process`): the thread owns the `LLM`.

`LLM` is not thread-safe, so exactly one thread -- the engine thread -- ever touches it. The
loop on that thread is:

    drain the inbox of commands (add / abort / stop)   -- blocking when there is no work
    step() while any request is unfinished
    hand each RequestOutput to its request's asyncio.Queue (loop.call_soon_threadsafe)
    publish a fresh stats snapshot

Callers on the event loop only put commands into the inbox and read immutable snapshots, so
an HTTP handler never waits for the engine and the engine never waits for a client.

Failure policy. Everything about a request that can be wrong is checked before it is
submitted (`check_prompt` here, `SamplingParams` for the sampling fields), and a request
that still fails when the engine thread adds it gets the error on its own stream only. An
exception inside `step()` is different: the scheduler and the device state may disagree
afterwards, and carrying on could hand other users wrong tokens. So the engine stops:
every open stream gets `EngineDeadError`, new requests are refused, and `is_healthy` turns
False (the server reports it on /health).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mrv2_jax.config import ENGINE_STARTUP_TIMEOUT
from mrv2_jax.core_client import AttachedCoreClient, CoreClient, EngineProcessDied
from mrv2_jax.data_parallel import EngineReplicas
from mrv2_jax.engine import core_messages as M
from mrv2_jax.engine import distributed
from mrv2_jax.engine.hand_over import Dispatch
from mrv2_jax.engine.output import RequestOutput
from mrv2_jax.engine.output_processor import OutputProcessor
from mrv2_jax.engine.request import Request
from mrv2_jax.engine.request_checks import check_automaton_fits, check_request, check_request_fits
from mrv2_jax.gc_heap import relaxed_collection
from mrv2_jax.request_stream import RequestStream, Sink
from mrv2_jax.sampling_params import SamplingParams
from mrv2_jax.spec_decode.metrics import SpecDecodeStats
from mrv2_jax.structured.compiler import ConstraintCompiler

if TYPE_CHECKING:  # the offline engine loads JAX: only an engine on a thread of this process needs it
    from mrv2_jax.llm import LLM

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a step failed); nothing more will run."""


class RequestRejected(ValueError):
    """A request that cannot run as asked (the prompt is empty, too long, ...). ``code`` is a
    machine-readable reason, e.g. ``"context_length_exceeded"``; ``param`` the request part
    at fault: ``"prompt"`` or ``"max_tokens"``."""

    def __init__(self, message: str, code: str | None = None, param: str | None = "prompt"):
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(frozen=True)
class EngineStats:
    """What the engine looked like after its latest step or command (read by /metrics and
    tests from any thread: the engine thread replaces the whole object, never mutates it)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    num_preemptions: int = 0
    num_aborted_reqs: int = 0
    num_steps: int = 0
    num_fused_calls: int = 0  # runner calls that ran several decode steps
    num_programs_pending: int = 0  # step programs not compiled yet (compile modes lazy, background)
    # Speculative decoding (spec_decode.metrics.SpecDecodeStats), None when off.
    spec_decode: object = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


# --- commands sent to the engine thread ------------------------------------------------------
@dataclass
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    sink: Sink
    streaming: bool = False


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncLLM:
    """Runs an engine behind an asyncio API: in its own process with
    `AsyncLLM.from_engine_args(...)` (or `AsyncLLM(client=CoreClient(...))`), or on a thread of
    this process around an existing `LLM` with `AsyncLLM(llm)` (the `LLM` then belongs to the
    engine thread: do not use it directly any more).

        stream = await engine.generate("The king said", SamplingParams(max_tokens=8))
        async for out in stream:
            print(out.delta_text, end="")

    `generate` validates and submits when awaited, so a bad request raises there (ValueError,
    or EngineDeadError) before any output is expected.
    """

    # How often the reader of an engine process looks for a stop while no message arrives.
    _READER_POLL_S = 0.1

    def __init__(self, llm: LLM | None = None, *,
                 client: CoreClient | AttachedCoreClient | EngineReplicas | None = None,
                 thread_name: str = "mrv2-engine"):
        if (llm is None) == (client is None):
            raise ValueError("AsyncLLM runs either an LLM on a thread or a CoreClient's engine process: give one")
        self._llm, self._client = llm, client
        if client is None:
            self.tokenizer = llm.tokenizer
            self.max_model_len: int = llm.engine.scheduler.max_model_len
            self.vocab_size: int = llm.model_state.vocab_size
            eos_token_ids = llm.model_state.eos_token_ids or ()
            self._automaton_capacity = llm.engine.runner.automaton_capacity
        else:
            self.tokenizer = client.tokenizer
            self.max_model_len, self.vocab_size = client.ready.max_model_len, client.ready.vocab_size
            eos_token_ids = client.ready.eos_token_ids
            self._automaton_capacity = tuple(client.ready.automaton_capacity)
            self._processor = OutputProcessor(self.tokenizer)  # the reader thread only
            if client.ready.startup and client.index == 0:
                logger.info("engine start-up (engine process): %s", json.dumps(client.ready.startup))
        # Constraints are compiled here first (off the event loop), so a bad one is a 400 and never
        # reaches the engine; the engine's own compile then finds it in the cache (same process)
        # or compiles it once more (the engine process).
        self._compiler = ConstraintCompiler(self.tokenizer, eos_token_ids, self.vocab_size) if self.tokenizer else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._ids = itertools.count()
        # Guards the hand-over between "submit a command" and "the engine died", so that no
        # command is left in the inbox of a dead engine with a caller waiting on it forever.
        # Re-entrant: RequestStream.__del__ may run (garbage collection) on a thread that
        # already holds it.
        self._lock = threading.RLock()
        self._error: BaseException | None = None
        self._stopped = False
        self._num_aborted = 0
        self._num_steps = 0
        # Called (on the engine or reader thread) with the time between two steps' outputs
        # arriving here while requests ran on both sides of it, and whether the later step
        # computed prompt tokens beside its decode rows; the server's metrics set it.
        self.on_step_interval: Callable[[float, bool], None] | None = None
        # Called with each step's hand-over to the engine's runner (engine/hand_over.py Dispatch).
        self.on_step_dispatch: Callable[[Dispatch], None] | None = None
        # With the engine in its own process, called on the reader thread for each step's message that
        # brings outputs of this process's requests: the seconds since the engine's previous step's
        # message left it (None: the engine was idle between), from this one leaving it to its outputs
        # reaching their streams here, and whether the step computed prompt tokens. Beside
        # on_step_interval they tell a late step from a late delivery.
        self.on_engine_step: Callable[[float | None, float, bool], None] | None = None
        self._last_step_at: float | None = None
        self._stats = EngineStats()
        if client is None:
            self._publish_stats()
        else:
            self._publish_core_stats(client.ready.stats)
        self._thread = threading.Thread(target=self._run if client is None else self._run_client,
                                        name=thread_name, daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str | None = None, *, engine_in_process: bool = False,
                         startup_timeout: float = ENGINE_STARTUP_TIMEOUT, api_server_count: int = 1,
                         data_parallel_size: int = 1, **engine_args) -> AsyncLLM:
        """The engine in its own process (waits until it is ready), or with `engine_in_process`
        on a thread of this one. `api_server_count` > 1: the engine also serves that many - 1
        other API processes (`client.attach_endpoints`; entrypoints/api_servers.py).
        `data_parallel_size` > 1: that many engine processes, one device each (data_parallel.py)."""
        distributed.refuse_serving(engine_args.get("num_processes"))
        if engine_in_process:
            if api_server_count != 1 or data_parallel_size != 1:
                raise ValueError("several API server processes or engine replicas need the engine in its own process")
            from mrv2_jax.llm import LLM

            return cls(LLM(model, **engine_args))
        if data_parallel_size > 1:
            return cls(client=EngineReplicas(dict(model=model, **engine_args), data_parallel_size, startup_timeout,
                                             api_server_count))
        return cls(client=CoreClient(dict(model=model, **engine_args), startup_timeout, api_server_count))

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None when the engine runs on a thread here)."""
        return None if self._client is None else self._client.ready.pid

    @property
    def api_server_index(self) -> int:
        """Which of the API server processes on this engine this one is (0: the one that owns it)."""
        return 0 if self._client is None else self._client.index

    @property
    def client(self) -> CoreClient | AttachedCoreClient | EngineReplicas | None:
        """The handle on the engine process (None when the engine runs on a thread here)."""
        return self._client

    # --- public API (any thread / the event loop) -------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def is_healthy(self) -> bool:
        return self._error is None and not self._stopped and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped, when it stopped because of a failure."""
        return self._error

    def check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestRejected` unless the prompt and the output budget fit the model."""
        n = len(token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty (it must have at least one token)")
        if params.structured_outputs is not None and not self._automaton_capacity[0]:
            raise RequestRejected("structured_outputs is not supported with this runner configuration "
                                  "(speculative decoding, or the v1 runner)", param="structured_outputs")
        if self._client is None:
            try:
                self._llm.engine.check_request(params)
            except ValueError as e:
                raise RequestRejected(str(e), param="prompt_logprobs") from None
        else:  # what LLM.add_request and EngineCore check, here before the request is sent
            ready = self._client.ready
            try:
                check_request(params, ready.supports_prompt_logprobs)
            except ValueError as e:
                raise RequestRejected(str(e), param="prompt_logprobs") from None
            try:
                check_request_fits(params, self.vocab_size, num_eos=ready.num_eos)
            except ValueError as e:
                raise RequestRejected(str(e), param=None) from None
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise RequestRejected(f"prompt token id {t} is out of range [0, {self.vocab_size})",
                                      code="invalid_token_id")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt has {n}: it must be shorter, to leave room for at least one output "
                "token", code="context_length_exceeded")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{n + params.max_tokens} were requested ({n} in the prompt, {params.max_tokens} "
                "for the completion); reduce the prompt or max_tokens",
                code="context_length_exceeded", param="max_tokens")

    def _check_constraint(self, params: SamplingParams) -> None:
        """Compile a request's constraint (cached) and check that the engine can hold it."""
        if self._compiler is None:
            raise RequestRejected("structured_outputs needs the model's tokenizer, and this model has none",
                                  param="structured_outputs")
        try:
            check_automaton_fits(self._compiler.compile(params.structured_outputs), self._automaton_capacity)
        except ValueError as e:
            raise RequestRejected(str(e), param="structured_outputs") from None

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize off the event loop (a 1 MiB prompt takes a noticeable time)."""
        if self.tokenizer is None:
            raise RequestRejected("this model has no tokenizer: send the prompt as token ids")
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, streaming: bool = False) -> RequestStream:
        """Validate and submit one request; returns the stream of its outputs. A str prompt is
        tokenized as the offline `LLM` does it (`tokenizer.encode(prompt)`). `streaming`: the
        client reads the outputs as they come (the engine bounds the gap between them)."""
        if isinstance(prompt, str):
            token_ids = await self.tokenize(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        self.check_prompt(token_ids, params)
        if params.structured_outputs is not None:
            await asyncio.to_thread(self._check_constraint, params)
        request_id = request_id or f"req-{self.api_server_index}-{next(self._ids)}"
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._submit(_Add(request_id, token_ids, params, sink, streaming))
        return RequestStream(self, request_id, sink)

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op when it has finished already). Thread-safe, never blocks."""
        with self._lock:
            if self._error is None and not self._stopped:
                self._inbox.put(_Abort(request_id))
                if self._client is not None:
                    self._client.send(M.AbortRequests([request_id]))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine (thread or process; an attached API process only lets go of it); open
        streams end with `EngineDeadError`."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._inbox.put(_Stop())
        if self._client is not None:
            self._client.stop(timeout)  # the reader thread sees the exit and ends
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._client is not None and not self._thread.is_alive():
            self._client.close()

    def _submit(self, command: _Add) -> None:
        with self._lock:
            if self._error is not None or self._stopped:
                raise EngineDeadError(self._dead_message())
            self._inbox.put(command)  # (before the engine can answer: the reader registers it first)
            if self._client is not None:
                self._client.send(M.AddRequest(command.request_id, command.token_ids, command.params,
                                               command.streaming, self._client.index))

    def _dead_message(self) -> str:
        if isinstance(self._error, EngineDeadError):
            return str(self._error)
        if self._error is not None:
            return f"the engine stopped after an internal error: {self._error!r}"
        return "the engine has been shut down"

    # --- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        engine = self._llm.engine
        try:
            with relaxed_collection():  # no collection in nearly every step (gc_heap.py)
                while True:
                    if not self._drain_inbox(block=not engine.has_work()):
                        break
                    if engine.has_work():
                        outputs = self._llm.step()
                        self._num_steps += 1
                        self._note_step(engine.has_work(), engine.outputs_prefill_tokens)
                        self._note_dispatch(engine.dispatched)
                        self._deliver(outputs)
                    self._publish_stats()
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the engine is done
            logger.exception("engine step failed; the engine is stopping")
            with self._lock:
                self._error = exc
        self._close_all_streams()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when `block`). False on stop."""
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: _Add) -> None:
        if self._client is not None:  # sent to the engine already; its outputs come here
            self._processor.add(Request(cmd.request_id, cmd.token_ids, cmd.params, streaming=cmd.streaming))
            self._sinks[cmd.request_id] = cmd.sink
            return
        try:
            # Token ids, not text: the caller has tokenized already (the same way LLM would).
            self._llm.add_request(cmd.token_ids, cmd.params, request_id=cmd.request_id, streaming=cmd.streaming)
        except Exception as exc:  # this request is bad: tell its caller, keep serving the rest
            self._llm.abort([cmd.request_id])
            self._send(cmd.sink, [exc])
            return
        self._sinks[cmd.request_id] = cmd.sink

    def _abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            if self._client is None:
                self._llm.abort([request_id])
            else:
                self._processor.remove([request_id])
            self._num_aborted += 1

    def _note_step(self, still_busy: bool, prefill_tokens: int) -> None:
        """Report the interval since the previous step's outputs, unless the engine was idle in it."""
        now = time.monotonic()
        if self._last_step_at is not None and self.on_step_interval is not None:
            self.on_step_interval(now - self._last_step_at, prefill_tokens > 0)
        self._last_step_at = now if still_busy else None

    def _note_dispatch(self, dispatched: Dispatch | None) -> None:
        if dispatched is not None and self.on_step_dispatch is not None:
            self.on_step_dispatch(dispatched)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand the step's outputs over with one wake-up per event loop, not per output."""
        by_sink: dict[int, tuple[Sink, list]] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            by_sink.setdefault(id(sink), (sink, []))[1].append(out)
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for sink, items in by_sink.values():
            by_loop[sink.loop].append((sink.queue, items))
        for loop, batch in by_loop.items():
            if not self._post(loop, batch):
                # The caller's event loop is gone: nobody can read these requests any more.
                for _, items in batch:
                    self._abort(items[0].request_id)
                    if self._client is not None:
                        self._client.send(M.AbortRequests([items[0].request_id]))

    def _send(self, sink: Sink, items: list) -> None:
        self._post(sink.loop, [(sink.queue, items)])

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, batch: list) -> bool:
        def put_all():
            for q, items in batch:
                for item in items:
                    q.put_nowait(item)

        try:
            loop.call_soon_threadsafe(put_all)
            return True
        except RuntimeError:  # loop closed
            return False

    def _close_all_streams(self) -> None:
        with self._lock:
            self._stopped = True
            pending = []
            while True:
                try:
                    pending.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        error = EngineDeadError(self._dead_message())
        sinks = list(self._sinks.values()) + [c.sink for c in pending if isinstance(c, _Add)]
        self._sinks.clear()
        for sink in sinks:
            self._send(sink, [error])
        try:
            self._publish_stats()
        except Exception:  # the scheduler may be what broke; the last snapshot stays
            pass

    def _publish_stats(self) -> None:
        if self._client is not None:  # the engine's counters come with its messages
            self._stats = dataclasses.replace(self._stats, num_aborted_reqs=self._num_aborted)
            return
        scheduler = self._llm.engine.scheduler
        s = scheduler.get_stats()
        kv = scheduler.kv_cache_manager
        self._stats = EngineStats(
            num_running_reqs=s.num_running_reqs, num_waiting_reqs=s.num_waiting_reqs,
            num_free_blocks=kv.num_free_blocks, num_blocks=kv.num_blocks, kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, num_aborted_reqs=self._num_aborted, num_steps=self._num_steps,
            num_fused_calls=getattr(getattr(self._llm.engine, "runner", None), "num_fused_calls", 0),
            num_programs_pending=getattr(getattr(self._llm.engine, "runner", None), "num_programs_pending", 0),
            spec_decode=s.spec_decode)

    # --- the reader thread of an engine process ----------------------------------------------
    def _run_client(self) -> None:
        client = self._client
        try:
            while True:
                try:
                    msg = client.recv(self._READER_POLL_S)
                except EngineProcessDied as died:
                    if not self._drain_inbox(block=False):
                        break  # we asked it to stop
                    if died.exitcode is None:  # an attached client whose owner (and engine) is gone
                        raise EngineDeadError("the engine's owning API process exited") from None
                    raise EngineDeadError(f"the engine process died unexpectedly (exit code {died.exitcode})") from None
                if not self._drain_inbox(block=False):
                    break
                if msg is None:
                    continue
                if isinstance(msg, M.EngineDied):  # an attached client: the owner saw the engine exit
                    raise EngineDeadError(f"the engine process died unexpectedly (exit code {msg.exitcode})")
                if isinstance(msg, M.EngineFailed):
                    logger.error("an engine step failed in the engine process:\n%s", msg.traceback)
                    raise EngineDeadError(f"the engine stopped after an internal error: {msg.error}")
                if isinstance(msg, M.StepOutputs):
                    self._apply_step(msg)
                elif isinstance(msg, M.StreamedTokens):
                    self._apply_streamed(msg)
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the engine is done
            logger.error("the engine is stopping: %s", exc)
            with self._lock:
                self._error = exc
        self._close_all_streams()

    def _apply_step(self, msg: M.StepOutputs) -> None:
        """One engine step: detokenize, find stop strings (the engine finishes those requests),
        hand the outputs to their streams, publish the engine's counters."""
        for request_id, why in msg.errors:  # adds the engine refused: the request fails alone
            self._processor.remove([request_id])
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                self._send(sink, [ValueError(why)])
        for out in msg.outputs:
            if out.new_logprobs is not None:
                out.new_logprobs = M.logprob_rows(out.new_logprobs)
            if out.prompt_logprobs is not None:
                out.prompt_logprobs = M.logprob_rows(out.prompt_logprobs)
        outputs, stopped = self._processor.process(msg.outputs)
        if stopped:
            self._client.send(M.FinishRequests(stopped))
        self._note_step(msg.stats.num_running_reqs + msg.stats.num_waiting_reqs > 0, msg.prefill_tokens)
        self._note_dispatch(None if msg.dispatch_s < 0 else Dispatch(
            msg.dispatch_s, msg.dispatch_prefill_tokens, msg.dispatch_cpu_s, msg.dispatch_call_s))
        self._deliver(outputs)
        if msg.outputs and msg.sent_at >= 0 and self.on_engine_step is not None:  # (steps of this process's requests)
            self.on_engine_step(None if msg.since_step_s < 0 else msg.since_step_s, time.monotonic() - msg.sent_at,
                                msg.prefill_tokens > 0)
        self._publish_core_stats(msg.stats)

    def _apply_streamed(self, msg: M.StreamedTokens) -> None:
        """Tokens streamed from inside a fused call: to their streams now (the call's step
        outputs bring them again; the output processor applies each token once)."""
        outputs, stopped = self._processor.streamed(msg.entries)
        if stopped:
            self._client.send(M.FinishRequests(stopped))
        self._deliver(outputs)

    def _publish_core_stats(self, s: M.CoreStats) -> None:
        self._stats = EngineStats(
            num_running_reqs=s.num_running_reqs, num_waiting_reqs=s.num_waiting_reqs,
            num_free_blocks=s.num_free_blocks, num_blocks=s.num_blocks, kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, num_aborted_reqs=self._num_aborted, num_steps=s.num_steps,
            num_fused_calls=s.num_fused_calls, num_programs_pending=s.num_programs_pending,
            spec_decode=None if s.spec_decode is None else SpecDecodeStats(**s.spec_decode))

