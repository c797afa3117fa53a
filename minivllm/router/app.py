"""The router: one OpenAI endpoint in front of several servers (`minivllm router --backend URL ...`).

Completions and chat completions go to the replica `PrefixAffinityPolicy` picks and come back
unchanged, streamed chunk by chunk when the request streams. Every `health_interval` seconds each
backend's /health is probed (and its /v1/models read, so requests route by `model` and one router
can front several models); a backend that fails a probe or a connection gets no new requests until a
probe succeeds again. A request that could not connect is retried on another replica (nothing reached
the first); one whose replica fails mid-flight gets an OpenAI error, 502 (mid-stream: an SSE error
event, then [DONE]). Needs no torch: it runs anywhere.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.router.policy import PrefixAffinityPolicy, Replica, estimate_tokens

logger = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)   # not a line per health probe

_FORWARDED_HEADERS = ("authorization", "content-type", "accept")
_RETURNED_HEADERS = ("content-type", "retry-after")
BACKEND_HEADER = "x-minivllm-backend"   # which replica answered (debugging, tests)


def error_json(status: int, message: str, type: str = "server_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def error_response(status: int, message: str, type: str = "server_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(error_json(status, message, type, code), status_code=status)


def prompt_text(body: dict) -> str:
    """The text whose prefix a replica caches: the prompt, or the chat messages in order."""
    if isinstance(body.get("messages"), list):
        parts = []
        for m in body["messages"]:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role') if isinstance(m, dict) else ''}>{content or ''}")
        return "".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class Router:
    def __init__(self, backends: list[str], health_interval: float = 2.0, api_key: str | None = None,
                 **policy_options) -> None:
        self.replicas = [Replica(url.rstrip("/"), healthy=False) for url in backends]
        self.policy = PrefixAffinityPolicy(self.replicas, **policy_options)
        self.health_interval = health_interval
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client: httpx.AsyncClient | None = None

    # ---- health ---------------------------------------------------------------------------------------
    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            logger.warning("backend %s is down: %s", replica.url, reason)
            self.policy.forget(replica)
        replica.healthy, replica.last_error = False, reason

    async def probe(self, replica: Replica) -> None:
        try:
            response = await self.client.get(replica.url + "/health", timeout=5)
            if response.status_code != 200:
                raise RuntimeError(f"/health answered {response.status_code}")
            if not replica.models:
                models = await self.client.get(replica.url + "/v1/models", headers=self.headers, timeout=5)
                if models.status_code == 200:
                    replica.models = {card["id"] for card in models.json().get("data", [])}
        except Exception as e:
            self.mark_down(replica, f"{type(e).__name__}: {e}")
            return
        if not replica.healthy:
            logger.info("backend %s is up (models %s)", replica.url, sorted(replica.models))
        replica.healthy, replica.last_error = True, None

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    async def health_loop(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.health_interval)

    # ---- proxying ---------------------------------------------------------------------------------------
    async def proxy(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            return error_response(400, "the request body must be a JSON object", "invalid_request_error")
        model = body.get("model")
        text = prompt_text(body)
        cost = estimate_tokens(text, body.get("max_tokens") or body.get("max_completion_tokens"))
        hashes = self.policy.prefix_hashes(model, text)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        tried: set[str] = set()
        while True:
            replica = self.policy.choose(model, hashes, tried)
            if replica is None:
                if not any(r.serves(model) for r in self.replicas):
                    return error_response(404, f"The model `{model}` does not exist.", "invalid_request_error",
                                          "model_not_found")
                return error_response(503, "no healthy backend can serve this request", code="no_backend")
            replica.outstanding_tokens += cost
            replica.in_flight += 1
            replica.num_requests += 1

            def release(replica=replica) -> None:
                replica.outstanding_tokens -= cost
                replica.in_flight -= 1
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", replica.url + path, content=raw, headers=headers),
                    stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:   # never reached it: try another
                release()
                self.mark_down(replica, f"{type(e).__name__}: {e}")
                tried.add(replica.url)
                continue
            except httpx.HTTPError as e:
                release()
                return self.failed(replica, e)
            if upstream.status_code == 200:
                self.policy.record(replica, hashes)
            returned = {k: v for k, v in upstream.headers.items() if k.lower() in _RETURNED_HEADERS}
            returned[BACKEND_HEADER] = replica.url
            if body.get("stream"):
                return StreamingResponse(self.passthrough(upstream, replica, release),
                                         status_code=upstream.status_code, headers=returned)
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                return self.failed(replica, e)
            finally:
                await upstream.aclose()
                release()
            return Response(content, status_code=upstream.status_code, headers=returned)

    def failed(self, replica: Replica, error: Exception) -> JSONResponse:
        replica.num_failures += 1
        self.mark_down(replica, f"{type(error).__name__}: {error}")
        return error_response(502, f"backend {replica.url} failed during the request: {type(error).__name__}",
                              code="backend_failed")

    async def passthrough(self, upstream: httpx.Response, replica: Replica, release):
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            replica.num_failures += 1
            self.mark_down(replica, f"{type(e).__name__}: {e}")
            error = error_json(502, f"backend {replica.url} failed mid-stream: {type(e).__name__}",
                               code="backend_failed")
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()
            release()

    async def any_backend(self, request: Request, path: str) -> Response:
        """Requests with no prompt affinity (tokenize, detokenize): the least loaded replica."""
        raw = await request.body()
        try:
            model = json.loads(raw).get("model")
        except (ValueError, AttributeError):
            model = None
        replica = self.policy.choose(model, [])
        if replica is None:
            return error_response(503, "no healthy backend can serve this request", code="no_backend")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        try:
            upstream = await self.client.post(replica.url + path, content=raw, headers=headers)
        except httpx.HTTPError as e:
            return self.failed(replica, e)
        return Response(upstream.content, status_code=upstream.status_code,
                        headers={k: v for k, v in upstream.headers.items() if k.lower() in _RETURNED_HEADERS})

    def models(self) -> dict:
        names = sorted({m for r in self.replicas if r.healthy for m in r.models})
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "minivllm"} for m in names]}

    def metrics(self) -> str:
        lines = []
        for name, kind, help_text, value in (
                ("backend_healthy", "gauge", "1 if the backend passed its last health check.", lambda r: int(r.healthy)),
                ("backend_outstanding_tokens", "gauge", "Estimated tokens of requests in flight.",
                 lambda r: r.outstanding_tokens),
                ("backend_requests_total", "counter", "Requests sent to the backend.", lambda r: r.num_requests),
                ("backend_failures_total", "counter", "Requests that failed at the backend.", lambda r: r.num_failures)):
            lines += [f"# HELP minivllm_router:{name} {help_text}", f"# TYPE minivllm_router:{name} {kind}"]
            lines += [f'minivllm_router:{name}{{backend="{r.url}"}} {value(r)}' for r in self.replicas]
        return "\n".join(lines) + "\n"


def build_router_app(backends: list[str], health_interval: float = 2.0, api_key: str | None = None,
                     **policy_options) -> FastAPI:
    router = Router(backends, health_interval, api_key, **policy_options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        router.client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))
        await router.probe_all()
        task = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await router.client.aclose()

    app = FastAPI(title="minivllm router", lifespan=lifespan)
    app.state.router = router

    def forward_to(handler, path: str):
        async def endpoint(request: Request) -> Response:
            return await handler(request, path)
        return endpoint

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, forward_to(router.proxy, path), methods=["POST"])
    for path in ("/tokenize", "/detokenize"):
        app.add_api_route(path, forward_to(router.any_backend, path), methods=["POST"])

    @app.get("/v1/models")
    async def models():
        return JSONResponse(router.models())

    @app.get("/health")
    async def health():
        return Response(status_code=200 if any(r.healthy for r in router.replicas) else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics(), media_type="text/plain; version=0.0.4")

    return app


def run_router(backends: list[str], host: str, port: int, health_interval: float = 2.0,
               api_key: str | None = None, log_level: str = "info") -> None:
    import uvicorn
    uvicorn.run(build_router_app(backends, health_interval, api_key), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)
