"""Errors as OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`.

Owns the mapping from failures to HTTP statuses: bad input is a 400 (FastAPI's 422 for schema
errors included), a wrong key 401, an unknown model 404, a full waiting queue 429 with
`Retry-After`, a dead engine 503. Anything else is a bug and becomes a 500 with the same shape.
"""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.core.scheduler import SchedulerFullError
from minivllm.engine.async_engine import EngineDeadError
from minivllm.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# Seconds a client should wait after a 429 before retrying.
RETRY_AFTER_S = 1


class OpenAIError(Exception):
    def __init__(self, status_code: int, message: str, type: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def to_dict(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=scrub(self.message), type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status_code, headers=self.headers)


# What an error message must never carry: a traceback, or a file system path of this machine.
_TRACEBACK = re.compile(r"Traceback \(most recent call last\).*", re.DOTALL)
_PATH = re.compile(r"(?<![\w/:.])(?:[A-Za-z]:)?(?:[/\\][\w.@+-]+){2,}[/\\]?")


def scrub(message: str) -> str:
    """The message without tracebacks or file paths (an exception's text may quote either)."""
    return _PATH.sub("<path>", _TRACEBACK.sub("", message)).strip() or "Invalid request."


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param=param)


def unauthorized() -> OpenAIError:
    return OpenAIError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'.",
                       "invalid_request_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                       param="model", code="model_not_found")


def too_many_requests(reason: str) -> OpenAIError:
    return OpenAIError(429, f"The server is at capacity, try again later: {reason}", "rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})


def engine_unavailable(reason: str) -> OpenAIError:
    return OpenAIError(503, f"The engine is not running: {reason}", "server_error", code="engine_unavailable")


def shutting_down() -> OpenAIError:
    return OpenAIError(503, "The server is shutting down and admits no new requests.", "server_error",
                       code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})


def request_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(408, f"The request did not finish within the server's request timeout ({seconds:g} s).",
                       "timeout_error", code="request_timeout")


def internal_error() -> OpenAIError:
    return OpenAIError(500, "Internal server error; the request failed and was logged.", "server_error",
                       code="internal_error")


def _param_of(message: str, known: set[str]) -> str | None:
    """SamplingParams' messages start with the field's name ('temperature must be ...')."""
    first = message.split(" ", 1)[0]
    return first if first in known else None


_SAMPLING_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "max_tokens", "min_tokens", "logprobs", "seed", "logit_bias",
                    "top_logprobs", "stop"}


def from_exception(error: BaseException) -> OpenAIError:
    """The error object for an exception raised while admitting or running a request."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, SchedulerFullError):
        return too_many_requests(str(error))
    if isinstance(error, (ValueError, TypeError)):
        return bad_request(str(error), _param_of(str(error), _SAMPLING_FIELDS))
    if isinstance(error, EngineDeadError):
        return engine_unavailable(str(error))
    logger.error("request failed", exc_info=error)
    return internal_error()


def _param_from_loc(loc: list) -> str | None:
    """'messages.0.role' from pydantic's location; union members ('stop.str') and dict keys are dropped:
    after the top-level field, a name is kept only right after a list index."""
    kept: list[str] = []
    for i, part in enumerate(loc):
        if i == 0 or isinstance(part, int) or isinstance(loc[i - 1], int):
            kept.append(str(part))
        else:
            break
    return ".".join(kept) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    param = _param_from_loc([part for part in first.get("loc", ()) if part != "body"])
    if first.get("type") == "json_invalid":
        return f"Request body is not valid JSON: {first.get('msg')}", None
    where = f" for '{param}'" if param else ""
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"Invalid value{where}: {first.get('msg')}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return bad_request(message, param).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OpenAIError(exc.status_code, str(exc.detail), kind, headers=exc.headers).to_response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).to_response()
