"""The FastAPI app and `run_server`: routes, API-key check, engine start/stop with the app's lifespan.

`ServerThread` serves an app from a background thread (tests, benchmarks, notebooks).

Routes: POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize (and, with runtime LoRA updating,
/v1/load_lora_adapter, /v1/unload_lora_adapter); GET /v1/models, /health,
/version, /metrics, /dashboard. `LimitsMiddleware` guards them all: with an API key set, every path
except `limits.api_key_exempt_paths` (/health and /metrics by default) needs `Authorization: Bearer
<key>`; body size, JSON depth and header count are bounded; SIGTERM drains (see shutdown.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from importlib import metadata
from pathlib import Path

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from minivllm.distributed import launched_by_torchrun
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server import dashboard, errors
from minivllm.server.limits import LimitsMiddleware, QueuedTokens, ServerLimits
from minivllm.server.lora import LoRAModules, lora_router
from minivllm.server.metrics import ServerMetrics
from minivllm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from minivllm.server.serving_chat import OpenAIServingChat
from minivllm.server.serving_completion import OpenAIServingCompletion
from minivllm.server.shutdown import GracefulServer

logger = logging.getLogger(__name__)


def _version() -> str:
    try:
        return metadata.version("minivllm")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def build_app(engine: AsyncEngine, served_model_name: str | list[str] | None = None,
              api_key: str | None = None, limits: ServerLimits | None = None, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, lora_modules: list[tuple[str, str]] | None = None,
              allow_runtime_lora_updating: bool = False) -> FastAPI:
    """An app serving `engine`; the engine loop starts and stops with the app's lifespan. `lora_modules`:
    (name, adapter folder) pairs served as models (with an engine started with enable_lora)."""
    limits = limits or ServerLimits()
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [engine.model_name]
    metrics = ServerMetrics(engine.get_stats, names[0])
    chat = OpenAIServingChat(engine, names, metrics, tool_call_parser=tool_call_parser,
                             enable_auto_tool_choice=enable_auto_tool_choice)
    completion = OpenAIServingCompletion(engine, names, metrics)
    queued_tokens = QueuedTokens(limits.max_queued_tokens)
    loras = None
    if getattr(engine.config, "enable_lora", False):
        loras = LoRAModules(engine, names[0], lora_modules or [])
    elif lora_modules or allow_runtime_lora_updating:
        raise ValueError("LoRA adapters need an engine started with enable_lora (--enable-lora)")
    for serving in (chat, completion):
        serving.limits, serving.queued_tokens, serving.lora_modules = limits, queued_tokens, loras

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        startup = getattr(app.state, "startup", None)
        if startup is not None:   # run_server's: the server now accepts requests
            startup.finish(metrics)
        try:
            if loras is not None:
                await loras.load_startup_modules()
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="minivllm", version=_version(), lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.queued_tokens = queued_tokens
    app.state.draining = False
    app.state.num_api_requests = 0
    errors.install_error_handlers(app)
    app.add_middleware(LimitsMiddleware, limits=limits, api_key=api_key, state=app.state)

    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        limits.check_request(request)
        return await chat.create_chat_completion(request, raw_request)

    @router.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        limits.check_request(request)
        return await completion.create_completion(request, raw_request)

    @router.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len,
                           quantization=engine.quantization) for name in names]
        if loras is not None:
            cards += loras.cards(engine.max_model_len)
        return JSONResponse(ModelList(data=cards).model_dump())

    @router.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        chat.model_name(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise errors.bad_request("give exactly one of 'prompt' or 'messages'")
        if request.messages is not None:
            tokens = chat.render_chat(request.messages, request.add_generation_prompt)
        else:
            tokens = list(chat.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
        return JSONResponse({"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens})

    @router.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        chat.model_name(request.model)
        vocab_size = engine.vocab_size
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in request.tokens):
            raise errors.bad_request(f"token ids must be in [0, {vocab_size})", param="tokens")
        return JSONResponse({"prompt": chat.tokenizer.decode(request.tokens)})

    app.include_router(router)
    if loras is not None and allow_runtime_lora_updating:
        app.include_router(lora_router(loras))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running and not app.state.draining else 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": _version()})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    dashboard.install(app, engine, metrics)
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before the (slow) engine loads, so a taken port fails fast and port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def make_server(app: FastAPI, log_level: str = "info", limits: ServerLimits | None = None,
                shutdown_timeout: float = 30.0) -> uvicorn.Server:
    # timeout_graceful_shutdown: streams still open at Ctrl-C are cut, and their requests aborted.
    # h11 (not httptools) so that the head-size limit below is the one in force.
    head_limit = (limits or ServerLimits()).h11_max_incomplete_event_size
    config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=30, timeout_graceful_shutdown=5,
                            http="h11", h11_max_incomplete_event_size=head_limit)
    return GracefulServer(config, shutdown_timeout)


def run_server(engine_config, host: str = "0.0.0.0", port: int = 8000, served_model_name=None,
               api_key: str | None = None, log_level: str = "info", limits: ServerLimits | None = None,
               shutdown_timeout: float = 30.0, **tool_options) -> None:
    """Load the engine, then serve until interrupted; SIGTERM drains first and exits 0.
    `tool_options`: tool_call_parser, enable_auto_tool_choice, lora_modules, allow_runtime_lora_updating."""
    if launched_by_torchrun() and int(os.environ["RANK"]) > 0:
        AsyncEngine.from_config(engine_config)   # serves the driver's steps, then exits (SystemExit)
        return
    startup = StartupTimes()
    sock = bind_socket(host, port)
    startup.lap("bind_socket")
    import minivllm.engine.llm_engine  # noqa: F401  (the engine stack's modules: timed as their own phase)
    startup.lap("engine_imports")
    engine = AsyncEngine.from_config(engine_config)
    startup.lap("engine_init")
    startup.phases.update(getattr(engine.engine, "startup_seconds", {}))
    app = build_app(engine, served_model_name, api_key, limits, **tool_options)
    server = make_server(app, log_level, limits, shutdown_timeout)
    startup.lap("build_app")
    app.state.startup = startup
    # uvicorn re-raises the signals it caught once it has stopped: a no-op SIGTERM handler makes a
    # drained shutdown exit 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    logger.info("serving %s on http://%s:%d", app.state.metrics.model_name, host, sock.getsockname()[1])
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises Ctrl-C after its graceful shutdown, which already stopped the engine


def _process_age() -> float | None:
    """Seconds since this process was created, from /proc in clock ticks since boot (None off Linux).
    psutil's create_time goes through the wall-clock boot time, which it rounds to a second."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        start_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class StartupTimes:
    """Seconds of each phase of `minivllm serve`'s start, logged as one JSON line (`startup phases (s): {...}`)
    and exported as `minivllm:startup_phase_seconds{phase=...}` once the server accepts requests. "imports" runs
    from the process's creation to `run_server` (interpreter, torch, transformers, the server's modules),
    "engine_imports" imports the engine stack (runner, models, kernels); the engine's phases (resolve_model,
    tokenizer, cuda_init, load_weights, profile_run, kv_cache_allocation, cuda_graph_capture) lie inside
    "engine_init"; "total" runs from the process's creation to serving."""

    def __init__(self) -> None:
        age = _process_age()
        self._mark = time.perf_counter()
        self.origin = self._mark - (age or 0.0)
        self.phases: dict[str, float] = {} if age is None else {"imports": age}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._mark
        self._mark = now

    def finish(self, metrics: ServerMetrics) -> None:
        self.lap("server_start")
        self.phases["total"] = time.perf_counter() - self.origin
        self.phases = {phase: round(seconds, 4) for phase, seconds in self.phases.items()}
        metrics.set_startup_phases(self.phases)
        logger.info("startup phases (s): %s", json.dumps(self.phases))


class ServerThread:
    """Serve `app` from a background thread on a free local port: `with ServerThread(app) as url: ...`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 limits: ServerLimits | None = None) -> None:
        self.sock = bind_socket(host, port)
        self.server = make_server(app, log_level, limits)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="minivllm-uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread failed to start")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
