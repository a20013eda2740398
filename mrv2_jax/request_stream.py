"""One request's outputs as an async iterator (`RequestStream`), fed by the engine's thread
through `Sink`, a queue that belongs to the caller's event loop (async_llm.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from mrv2_jax.engine.output import RequestOutput


@dataclass
class Sink:
    """Where one request's outputs go: a queue that belongs to the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output standing for two consecutive ones: the newer snapshot (token ids, text and
    logprobs are cumulative), with the text added by both."""
    return dataclasses.replace(newer, delta_text=older.delta_text + newer.delta_text,
                               prompt_logprobs=newer.prompt_logprobs or older.prompt_logprobs)


class RequestStream:
    """The outputs of one request, as an async iterator of `RequestOutput` (the last one has
    ``finished=True``). Leaving it early -- `abort()`, `aclose()`, `async with` exit, or the
    consuming task being cancelled -- aborts the request and frees its KV blocks.

    A reader that falls behind the engine gets one output for everything that arrived since
    its last read (the newest snapshot; ``delta_text`` holds all the new text), as vLLM's
    output collector does: under load a server then writes one chunk per read, not one per
    token, and catches up instead of falling further behind."""

    def __init__(self, engine, request_id: str, sink: Sink):
        """`engine`: what `abort(request_id)` is called on when the reader leaves early (an AsyncLLM)."""
        self.request_id = request_id
        self._engine = engine
        self._queue = sink.queue
        self._done = False
        self._held = None  # an error read while merging: raised on the next read

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item, self._held = self._held, None
        try:
            if item is None:
                item = await self._queue.get()
        except BaseException:  # cancelled (client gone): nobody will read the rest
            self.abort()
            raise
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            newer = self._queue.get_nowait()
            if isinstance(newer, BaseException):
                self._held = newer
                break
            item = merge(item, newer)
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    def __del__(self):
        # Safety net for a stream dropped without being read to the end or closed (e.g. a
        # streaming response whose client left before its first byte): free the request.
        try:
            self.abort()
        except Exception:  # interpreter shutdown; nothing left to free
            pass
