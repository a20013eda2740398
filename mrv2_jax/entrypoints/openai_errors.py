"""Errors in the OpenAI shape, and the handlers that make every failure one of them.

Every error response of the server -- bad JSON, a failed validation, an unknown model, a
missing API key, an oversized body, even an unexpected bug -- has the body OpenAI clients
parse: ``{"error": {"message", "type", "param", "code"}}``. Validation failures are 400 (as
OpenAI answers them), not FastAPI's default 422.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mrv2_jax.async_llm import EngineDeadError

logger = logging.getLogger(__name__)

# The `type` strings OpenAI's clients know, by status.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_error",
          503: "service_unavailable"}


class OpenAIError(Exception):
    """Raised anywhere in a handler to answer with this status and error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """A pydantic error list -> one 400 naming the first offending field (OpenAI's `param`)."""
    errors = exc.errors()
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
        if param is None and loc:
            param = loc[0]
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return bad_request("invalid request: " + "; ".join(parts) + more, param=param)


def from_value_error(exc: ValueError, fields: set[str] = frozenset()) -> OpenAIError:
    """`SamplingParams` and the engine raise ValueError with messages that start with the field
    name ("top_p must be in (0, 1], got 2"); use it as `param` when it is a request field."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = first if first in fields else None
    return bad_request(message, param=param, code=getattr(exc, "code", None))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError):
        return from_validation_error(exc).response()

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError):
        return from_validation_error(exc).response()

    @app.exception_handler(ValueError)  # RequestRejected, or a request the engine refused
    async def _rejected(request: Request, exc: ValueError):
        return from_value_error(exc).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return OpenAIError(503, str(exc), code="engine_dead").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # 404 for unknown paths, 405 for wrong methods: same shape as everything else.
        return OpenAIError(exc.status_code, str(exc.detail)).response(headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return OpenAIError(500, f"internal server error: {type(exc).__name__}").response()
