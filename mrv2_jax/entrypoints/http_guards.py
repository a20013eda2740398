"""Checks that run before a request reaches a route: the API key and the body size.

Both are plain ASGI middlewares, so they answer before FastAPI parses anything, and the
body limit holds for chunked uploads too (no Content-Length to trust): the body is read
here, at most `max_bytes` + 1 of it, and handed on to the route from memory.
"""

from __future__ import annotations

import hmac
import json

from mrv2_jax.entrypoints.openai_errors import OpenAIError

# Open without a key: load balancers and orchestrators probe it.
PUBLIC_PATHS = frozenset({"/health"})


async def _send_error(send, error: OpenAIError, headers: list | None = None) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Every path but /health needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        # Constant-time comparison: response timing must not reveal how much of a guess matched.
        if not hmac.compare_digest(given, self.expected):
            return await _send_error(
                send, OpenAIError(401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
                                  code="invalid_api_key"),
                headers=[(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuses request bodies larger than `max_bytes` with 413."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"request body too large (the limit is {self.max_bytes} bytes)",
                           code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _send_error(send, OpenAIError(400, "invalid Content-Length header"))
            if int(length) > self.max_bytes:
                return await _send_error(send, self._too_large())
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_error(send, self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, delivered = b"".join(chunks), False

        async def replay():
            # The body once; after that the real channel, so the route still hears disconnects.
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
