"""Limits that keep the server up under abuse, enforced before a request reaches a route.

`ServerLimits` holds them; `LimitsMiddleware` (plain ASGI, so it sees every route, unknown ones too)
checks, in order: header count and size (431), draining for shutdown (503), the API key (401, except on
exempt paths), the body size (413, from Content-Length and again while reading a chunked body) and the
JSON nesting depth (400; a deep body would otherwise exhaust the parser's recursion). Bodies are read
whole here (they are bounded), checked, and replayed to the app.

`QueuedTokens` is the admission budget: prompt + max_tokens × n of every admitted, unfinished request.
A request that would exceed it gets 429 with Retry-After. Caps on max_tokens and n and the per-request
timeout are applied by the serving layer from the same `ServerLimits`.
"""
from __future__ import annotations

import re
import secrets
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minivllm.server import errors

# Paths a request to which counts as in flight for a graceful shutdown (the dashboard's event stream
# and probes never end a drain early or late).
_API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@dataclass
class ServerLimits:
    max_request_body_bytes: int = 8 << 20
    max_json_depth: int = 64
    h11_max_header_count: int = 256               # vLLM's default
    h11_max_incomplete_event_size: int = 4 << 20  # vLLM's default: bytes of one request's headers
    max_tokens_limit: int | None = None           # cap on max_tokens (None: max_model_len decides)
    max_n: int = 64                               # cap on n (and best_of)
    max_queued_tokens: int | None = None          # admission budget in tokens (None: unlimited)
    request_timeout: float | None = None          # seconds from arrival to the last token
    api_key_exempt_paths: tuple[str, ...] = ("/health", "/metrics")

    def check_request(self, request) -> None:
        """The caps on what a request asks for (400); a default max_tokens is clamped at admission."""
        asked = getattr(request, "model_fields_set", ())  # a field's default (16 for completions) is no ask
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(request, name, None) if name in asked else None
            if self.max_tokens_limit is not None and value is not None and value > self.max_tokens_limit:
                raise errors.bad_request(f"{name} must be at most {self.max_tokens_limit}, got {value}", param=name)
        n = getattr(request, "n", None)
        if n is not None and n > self.max_n:
            raise errors.bad_request(f"n must be at most {self.max_n}, got {n}", param="n")

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_json_depth", "h11_max_header_count",
                     "h11_max_incomplete_event_size", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_tokens_limit", "max_queued_tokens", "request_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(body: bytes) -> int:
    """Deepest nesting of arrays/objects in a JSON text, brackets inside strings ignored; linear time."""
    data = np.frombuffer(_STRING.sub(b'""', body), dtype=np.uint8)
    step = (data == ord("[")).astype(np.int64) + (data == ord("{")) - (data == ord("]")) - (data == ord("}"))
    return int(np.cumsum(step).max(initial=0))


class QueuedTokens:
    """Tokens reserved by admitted, unfinished requests. `reserve` returns the release function; it
    runs once, when the request's streams close or, as a backstop, when they are garbage collected."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.total = 0

    def reserve(self, amount: int) -> Callable[[], None]:
        if self.limit is not None:
            if amount > self.limit:
                raise errors.bad_request(f"the request needs {amount} tokens (prompt + max_tokens × n), more than "
                                         f"the server admits at once ({self.limit})", param="max_tokens")
            if self.total + amount > self.limit:
                raise errors.too_many_requests(f"{self.total} tokens are queued (limit {self.limit})")
        self.total += amount
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.total -= amount

        return release

    @staticmethod
    def attach(release: Callable[[], None], owners: list) -> None:
        for owner in owners:
            owner.release_tokens = release
            weakref.finalize(owner, release)


async def _send_error(scope, send, error: errors.OpenAIError) -> None:
    await error.to_response()(scope, _no_body, send)


async def _no_body():
    return {"type": "http.disconnect"}


class LimitsMiddleware:
    def __init__(self, app, limits: ServerLimits, api_key: str | None, state) -> None:
        self.app = app
        self.limits = limits
        self.api_key = api_key
        self.state = state  # app.state: `draining` and `num_api_requests` live there

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        limits = self.limits
        headers = scope.get("headers", ())
        if len(headers) > limits.h11_max_header_count:
            return await _send_error(scope, send, errors.OpenAIError(
                431, f"too many request headers (limit {limits.h11_max_header_count})", "invalid_request_error"))
        # h11 enforces the head size only on heads that arrive in pieces; this holds for all of them.
        if sum(len(k) + len(v) for k, v in headers) > limits.h11_max_incomplete_event_size:
            return await _send_error(scope, send, errors.OpenAIError(
                431, f"request headers are larger than {limits.h11_max_incomplete_event_size} bytes",
                "invalid_request_error"))
        is_api = path.startswith(_API_PREFIXES)
        if self.state.draining and (is_api or path.startswith("/dashboard")):
            return await _send_error(scope, send, errors.shutting_down())
        if self.api_key is not None and path not in limits.api_key_exempt_paths and not self._authorized(scope):
            return await _send_error(scope, send, errors.unauthorized())
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            body = await self._read_body(receive, send, scope)
            if body is None:
                return
            if json_depth(body) > limits.max_json_depth:
                return await _send_error(scope, send, errors.bad_request(
                    f"the JSON body is nested deeper than {limits.max_json_depth} levels"))
            receive = _replay(body, receive)
        if not is_api:
            return await self.app(scope, receive, send)
        self.state.num_api_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_api_requests -= 1

    def _authorized(self, scope) -> bool:
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = header.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _read_body(self, receive, send, scope) -> bytes | None:
        limit = self.limits.max_request_body_bytes
        too_large = errors.OpenAIError(413, f"the request body is larger than {limit} bytes",
                                       "invalid_request_error", code="request_too_large")
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _send_error(scope, send, too_large if length.isdigit() else errors.bad_request("bad Content-Length"))
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(scope, send, too_large)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect, as the server would report it

    return replay
