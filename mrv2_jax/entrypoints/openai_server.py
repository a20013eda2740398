"""The OpenAI-compatible HTTP server: `create_app(engine)` builds the FastAPI app, `serve(...)`
runs it with uvicorn, `ServerThread` runs it in the background (tests, notebooks).

    /v1/completions, /v1/chat/completions   (stream: true -> server-sent events, then [DONE])
    /v1/models, /health, /metrics

A request goes: size limit and API key (http_guards) -> JSON -> strict schema
(openai_protocol) -> SamplingParams -> tokenize / chat template -> engine checks
(context length, token ids) -> submitted. Anything wrong on the way is a 4xx in OpenAI's
error shape before the engine sees the request. A client that goes away mid-request has its
request aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import anyio
import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from mrv2_jax.async_llm import AsyncLLM, EngineDeadError
from mrv2_jax.config import ENGINE_STARTUP_TIMEOUT, SERVER_SHUTDOWN_TIMEOUT
from mrv2_jax.entrypoints import openai_responses as R
from mrv2_jax.entrypoints.http_guards import APIKeyMiddleware, BodySizeLimitMiddleware
from mrv2_jax.entrypoints.openai_errors import OpenAIError, bad_request, from_value_error, install_error_handlers
from mrv2_jax.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from mrv2_jax.entrypoints.server_metrics import RequestTracker, ServerMetrics
from mrv2_jax.request_stream import RequestStream

logger = logging.getLogger(__name__)
_json_encode = msgspec.json.Encoder().encode

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any prompt the context can hold


def import_lazy_modules() -> None:
    """anyio imports most of itself on first use (sockets, streams), so a server process's first
    streamed response paid for those imports; called at start, off the request path."""
    for name in dir(anyio):
        getattr(anyio, name, None)


def create_app(engine: AsyncLLM, served_model_names: str | list[str] = "demo", *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app serving `engine` under the given model name(s) (the first is the one reported)."""
    names = [served_model_names] if isinstance(served_model_names, str) else list(served_model_names)
    if not names:
        raise ValueError("at least one served model name is needed")
    # No /docs or /openapi.json: the API is OpenAI's, and they would only widen the surface.
    app = FastAPI(title="mrv2-jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics = ServerMetrics(engine, names[0])
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # added last = runs first
    created = R.now()

    def check_model(name: str) -> str:
        if name not in names:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {names[0]!r}",
                              param="model", code="model_not_found")
        return name

    @app.get("/health")
    async def health():
        if not engine.is_healthy:
            raise OpenAIError(503, "the engine is not running" + (f": {engine.error!r}" if engine.error else ""),
                              code="engine_dead")
        return {"status": "ok", "api_server": engine.api_server_index}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "mrv2-jax",
             "max_model_len": engine.max_model_len} for n in names]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = CompletionRequest.model_validate(await _json_body(request))
        model = check_model(req.model)
        params = req.to_sampling_params(engine.vocab_size)
        tracker = metrics.track()
        rid = R.new_id("cmpl")
        stream = await _submit(engine, req.prompt, params, rid, param="prompt", streaming=req.stream,
                               constraint=req.constraint_field)
        fmt = R.LogprobFormatter(engine.tokenizer, params.logprobs) if params.logprobs is not None else None
        if req.stream:
            return _sse(_completion_events(stream, tracker, rid, model, fmt, req.include_usage_in_stream))
        out = await _run_to_end(stream, request, tracker)
        if out is None:
            return Response(status_code=499)  # nobody is listening any more
        return R.completion_response(rid, R.now(), model, out, R.completion_logprobs(fmt, out, R.DeltaTracker()))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = ChatCompletionRequest.model_validate(await _json_body(request))
        model = check_model(req.model)
        params = req.to_sampling_params(engine.vocab_size)
        token_ids = await _apply_chat_template(engine, req)
        tracker = metrics.track()
        rid = R.new_id("chatcmpl")
        stream = await _submit(engine, token_ids, params, rid, param="messages", streaming=req.stream,
                               constraint=req.constraint_field)
        fmt = R.LogprobFormatter(engine.tokenizer, params.logprobs) if params.logprobs is not None else None
        if req.stream:
            return _sse(_chat_events(stream, tracker, rid, model, fmt, req.include_usage_in_stream))
        out = await _run_to_end(stream, request, tracker)
        if out is None:
            return Response(status_code=499)
        return R.chat_response(rid, R.now(), model, out, R.chat_logprobs(fmt, out, R.DeltaTracker()))

    return app


# --- request handling helpers -------------------------------------------------------------
def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        # NaN / Infinity are Python extensions to JSON; deep nesting raises RecursionError.
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def _submit(engine: AsyncLLM, prompt, params, request_id: str, param: str, streaming: bool,
                  constraint: str) -> RequestStream:
    """`param`: the field holding the prompt; `constraint`: the one holding a structured-output constraint."""
    try:
        return await engine.generate(prompt, params, request_id=request_id, streaming=bool(streaming))
    except ValueError as e:  # RequestRejected: empty / too long / bad token ids / bad constraint
        at_fault = getattr(e, "param", "prompt")
        at_fault = {"prompt": param, "structured_outputs": constraint}.get(at_fault, at_fault)
        raise bad_request(str(e), param=at_fault, code=getattr(e, "code", None)) from None


async def _apply_chat_template(engine: AsyncLLM, req: ChatCompletionRequest) -> list[int]:
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template: use /v1/completions", param="messages")
    try:
        text = await asyncio.to_thread(tok.apply_chat_template, req.template_messages(), tokenize=False,
                                       add_generation_prompt=bool(req.add_generation_prompt))
    except Exception as e:  # a template may raise on conversations it does not accept
        raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from None
    # The template writes the special tokens itself; adding them again would duplicate them.
    return await engine.tokenize(text, add_special_tokens=False)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _run_to_end(stream: RequestStream, request: Request, tracker: RequestTracker):
    """The final output, or None if the client disconnected first (then the request is aborted)."""
    async def consume():
        last = None
        async for out in stream:
            tracker.observe(out)
            last = out
        return last

    result = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
            stream.abort()
            tracker.finish("abort")
    if result.cancelled():
        return None
    try:
        return result.result()  # raises the request's error, if it failed
    finally:
        tracker.finish("error" if result.exception() else None)


# --- streaming (server-sent events) -------------------------------------------------------
def _event(body: dict) -> bytes:
    # msgspec's encoder: one event per token per stream makes this the server's hottest line.
    return b"data: " + _json_encode(body) + b"\n\n"


def _sse(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _error_event(exc: Exception) -> str:
    if isinstance(exc, EngineDeadError):
        err = OpenAIError(503, str(exc), code="engine_dead")
    elif isinstance(exc, ValueError):
        err = from_value_error(exc)
    else:
        logger.exception("error while streaming a response")
        err = OpenAIError(500, f"internal server error: {type(exc).__name__}")
    return _event(err.body())


async def _stream_outputs(stream: RequestStream, tracker: RequestTracker, make_events, make_usage):
    """The SSE skeleton shared by both endpoints. Leaving early (client gone: the task is
    cancelled, or the generator closed) exits `async with stream`, which aborts the request."""
    async with stream:
        last = None
        try:
            async for out in stream:
                tracker.observe(out)
                last = out
                for event in make_events(out):
                    yield _event(event)
            tracker.finish()
            if make_usage is not None and last is not None:
                yield _event(make_usage(last))
        except Exception as exc:  # the engine failed this request: tell the client, then end
            tracker.finish("error")
            yield _error_event(exc)
        finally:
            tracker.finish("abort")  # no-op unless we are being torn down mid-stream
    yield b"data: [DONE]\n\n"


def _completion_events(stream, tracker, rid, model, fmt, include_usage):
    created, deltas, sent = R.now(), R.DeltaTracker(), R.TokenCount()

    def events(out):
        c = out.outputs[0]
        logprobs = R.completion_logprobs(fmt, out, deltas)
        if sent.new_tokens(out) or out.delta_text or c.finish_reason or logprobs:
            yield R.completion_chunk(rid, created, model, out.delta_text, c.finish_reason, logprobs, include_usage)

    usage = (lambda out: R.usage_chunk(rid, created, model, "text_completion", out)) if include_usage else None
    return _stream_outputs(stream, tracker, events, usage)


def _chat_events(stream, tracker, rid, model, fmt, include_usage):
    created, deltas, sent = R.now(), R.DeltaTracker(), R.TokenCount()
    state = {"first": True}

    def events(out):
        c = out.outputs[0]
        if state["first"]:  # OpenAI's streams open with the role
            state["first"] = False
            yield R.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None, None, include_usage)
        logprobs = R.chat_logprobs(fmt, out, deltas)
        new_tokens = sent.new_tokens(out)
        if new_tokens or out.delta_text or c.finish_reason or logprobs:
            delta = {"content": out.delta_text} if out.delta_text or new_tokens else {}
            yield R.chat_chunk(rid, created, model, delta, c.finish_reason, logprobs, include_usage)

    usage = (lambda out: R.usage_chunk(rid, created, model, "chat.completion.chunk", out)) if include_usage else None
    return _stream_outputs(stream, tracker, events, usage)


# --- running it -----------------------------------------------------------------------------
def _uvicorn_config(app, host: str, port: int, log_level: str, shutdown_timeout: float = 5.0):
    # Idle keep-alive connections close after 10 s; on SIGTERM / Ctrl-C the server stops
    # accepting and open requests get `shutdown_timeout` s to finish before they are cut.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=10,
                          timeout_graceful_shutdown=shutdown_timeout, access_log=log_level == "debug")


class _Terminated(Exception):
    """SIGTERM, re-raised by uvicorn after its graceful shutdown."""


class _Server(uvicorn.Server):
    """A uvicorn server that also calls `on_signal(signum)` when it gets SIGTERM or SIGINT."""

    def __init__(self, config: uvicorn.Config, on_signal=None):
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig, frame) -> None:
        if self._on_signal is not None:
            self._on_signal(sig)
        super().handle_exit(sig, frame)


def _raise_terminated(signum, frame):
    raise _Terminated()


def run_http_server(engine: AsyncLLM, host: str = "127.0.0.1", port: int = 8000, *, sock: socket.socket | None = None,
                    log_level: str = "info", shutdown_timeout: float = SERVER_SHUTDOWN_TIMEOUT, on_started=None,
                    on_signal=None, **app_kwargs) -> None:
    """Serve HTTP (on `sock` when given) until SIGTERM or Ctrl-C, then drain the requests in flight
    (up to `shutdown_timeout` seconds); the engine is left running. `on_started(server)` runs before
    the server does; `on_signal(signum)` runs in the signal handler."""
    import signal

    server = _Server(_uvicorn_config(create_app(engine, **app_kwargs), host, port, log_level, shutdown_timeout),
                     on_signal)
    # uvicorn handles SIGTERM itself and raises it again once drained: without a handler of ours
    # that would kill this process before the engine is stopped.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        if on_started is not None:
            on_started(server)
        server.run(sockets=None if sock is None else [sock])
    except (KeyboardInterrupt, _Terminated):  # uvicorn re-raises the signal it handled: the normal end
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve(engine: AsyncLLM, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          shutdown_timeout: float = SERVER_SHUTDOWN_TIMEOUT, api_server_count: int = 1,
          startup_timeout: float = ENGINE_STARTUP_TIMEOUT, **app_kwargs) -> None:
    """Serve until SIGTERM or Ctrl-C; then drain the requests in flight (up to `shutdown_timeout`
    seconds) and stop the engine (its process exits too). `api_server_count` > 1: that many API
    processes share the port and the engine (entrypoints/api_servers.py; the engine must have been
    started with as many endpoints: `AsyncLLM.from_engine_args(api_server_count=...)`)."""
    import signal

    from mrv2_jax.entrypoints.api_servers import ApiServerProcesses, listening_socket

    if api_server_count == 1:
        try:
            run_http_server(engine, host, port, log_level=log_level, shutdown_timeout=shutdown_timeout, **app_kwargs)
        finally:
            engine.shutdown()
        return
    endpoints = engine.client.attach_endpoints if engine.client is not None else []
    if len(endpoints) != api_server_count - 1:
        raise ValueError(f"the engine was started for {len(endpoints) + 1} API server process(es), "
                         f"not {api_server_count}")
    sock = listening_socket(host, port)
    others = ApiServerProcesses(endpoints, host, sock.getsockname()[1],
                                dict(log_level=log_level, shutdown_timeout=shutdown_timeout, **app_kwargs),
                                startup_timeout)
    try:
        # SIGTERM reaches only this process: pass it on, so that every process drains at once.
        run_http_server(engine, sock=sock, log_level=log_level, shutdown_timeout=shutdown_timeout,
                        on_signal=lambda signum: others.signal(signum) if signum == signal.SIGTERM else None,
                        on_started=others.start_beside, **app_kwargs)
        if others.failure is not None:
            raise RuntimeError(others.failure)
    finally:
        others.stop(shutdown_timeout + 10.0)
        sock.close()
        engine.shutdown()


class ServerThread:
    """A server on a background thread, on a free port of 127.0.0.1 unless `port` (or a listening
    `sock`) is given:

        with ServerThread(engine) as server:
            openai.OpenAI(base_url=server.url + "/v1", api_key="none")...
    """

    def __init__(self, engine: AsyncLLM, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 sock: socket.socket | None = None, **app_kwargs):
        self.engine = engine
        self.app = create_app(engine, **app_kwargs)
        # Binding here (port 0 = the OS picks) makes the port known before the thread starts.
        self._socket = sock or socket.create_server((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._server = uvicorn.Server(_uvicorn_config(self.app, host, self.port, log_level))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="mrv2-http", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
