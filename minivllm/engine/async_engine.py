"""AsyncEngine: an LLMEngine driven by an EngineLoop (engine/engine_loop.py), with one async stream per request.

The loop runs in a background thread (`AsyncEngine(engine)`, the library's way) or in a process of its own
(`AsyncEngine.spawn(config)`, what `minivllm serve` uses; engine/engine_process.py). In a thread the engine's
host work shares the GIL with the server's: every torch call releases it, and taking it back waits for the
event loop, which at 150 streams spends milliseconds a step writing chunks; the device then idles for the host
(`--collect-step-times`' idle histogram, serving.md). A process keeps the two apart.

Owns the per-request output queues and the futures of pending adds and calls. The `LLMEngine` is touched only
by the loop: coroutines hand it commands (add, abort, pause, resume, stop) in order, so an abort sent after an
add is always applied after it. Messages come back to the event loop once per step and are applied there,
so every piece of state here is read and written by the event loop's thread alone.

Does not know about HTTP; the server talks only to this class.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from minivllm.engine.engine_loop import SNAPSHOT_INTERVAL_S, EngineDeadError, EngineLoop
from minivllm.engine.stats import EngineInfo
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


__all__ = ["AsyncEngine", "EngineDeadError", "EngineInfo", "RequestStream"]


class RequestStream:
    """Async iterator over the outputs of one request.

    Outputs are cumulative, so when the consumer falls behind only the newest pending output is
    returned (earlier ones are contained in it). Closing an unfinished stream aborts the request.
    """

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self._closed = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
            # Coalesce: a newer cumulative output replaces older ones, but errors are never skipped.
            while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
                item = self._queue.get_nowait()
        except BaseException:
            # Cancelled while waiting (client gone): free the request's blocks.
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            self._engine._forget(self.request_id)
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Stop listening; aborts the request if it has not finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._engine.abort(self.request_id)
        self._engine._forget(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class ThreadLoop:
    """The EngineLoop in a daemon thread of this process; commands go through a FIFO queue."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def _next_command(self, block: bool) -> tuple | None:
        try:
            return self.commands.get(block=block)
        except queue.Empty:
            return None

    def start(self, loop: asyncio.AbstractEventLoop, handle) -> None:
        """Run the loop; each of its messages reaches `handle` on the event loop's thread."""
        def on_message(message: tuple) -> None:
            try:
                loop.call_soon_threadsafe(handle, message)
            except RuntimeError:   # the event loop is closed: nobody is waiting any more
                pass

        engine_loop = EngineLoop(self.engine, self._next_command, on_message)
        self.thread = threading.Thread(target=engine_loop.run, name="minivllm-engine", daemon=True)
        self.thread.start()

    def send(self, command: tuple) -> None:
        self.commands.put(command)

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self) -> None:
        self.thread.join()

    def close(self) -> None:   # never started: release the engine here
        self.engine.shutdown()


class AsyncEngine:
    """Runs the engine loop (a thread, or a process with `spawn`) while requests stream through asyncio queues."""

    SNAPSHOT_INTERVAL_S = SNAPSHOT_INTERVAL_S

    def __init__(self, engine: Any = None, *, runner: Any = None, info: EngineInfo | None = None,
                 tokenizer: Any = None, stats: Any = None) -> None:
        """`AsyncEngine(engine)`: the loop runs `engine` in a thread. (`spawn` passes the process's `runner`,
        with the engine's `info`, the server's own `tokenizer` and the first `stats` instead.)"""
        self.engine = engine   # the LLMEngine in this process (None when it lives in the engine process)
        self._runner = runner if runner is not None else ThreadLoop(engine)
        self.info = info if info is not None else EngineInfo.of(engine)
        self._tokenizer = tokenizer if engine is None else getattr(engine, "tokenizer", None)
        self._stats = stats if engine is None else engine.get_stats()
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[int, asyncio.Future] = {}   # adds and calls the loop has not answered yet
        self._tokens = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._dead: BaseException | None = None
        self.snapshot_subscribers = 0
        self._snapshot: dict | None = None
        self._snapshot_interval = SNAPSHOT_INTERVAL_S

    @classmethod
    def from_config(cls, config: Any) -> AsyncEngine:
        """The engine built here, its loop in a thread of this process."""
        from minivllm.engine.llm_engine import LLMEngine
        return cls(LLMEngine(config))

    @classmethod
    def spawn(cls, config: Any, build=None) -> AsyncEngine:
        """The engine built and run in a process of its own; returns once it is ready (raises what building it
        raised). The tokenizer is loaded here while the engine process loads the weights. `build`: what builds
        the engine there (engine_process.build_llm_engine, an LLMEngine for `config`, by default)."""
        from minivllm.engine.engine_process import EngineProcess
        process = EngineProcess(config) if build is None else EngineProcess(config, build)
        tokenizer, info, stats = process.wait_ready()
        return cls(runner=process, info=info, tokenizer=tokenizer, stats=stats)

    # ---- what the server reads -------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def quantization(self) -> str | None:
        return self.info.quantization

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int | None:
        return self.info.vocab_size

    @property
    def config(self) -> Any:
        return self.info.config

    @property
    def startup_seconds(self) -> dict:
        return self.info.startup_seconds

    def get_stats(self) -> Any:
        """The engine stats as of the end of the last step or command batch (never blocks)."""
        return self._stats

    @property
    def snapshot_interval(self) -> float:
        """Seconds between the loop's snapshots (longer than SNAPSHOT_INTERVAL_S for a large pool)."""
        return self._snapshot_interval

    def get_snapshot(self) -> dict | None:
        """The latest engine snapshot (queues, KV pool) taken by the loop, with its monotonic time."""
        return self._snapshot

    def subscribe_snapshots(self, delta: int) -> None:
        """Count a dashboard subscriber in (+1) or out (-1); a new one gets a snapshot even when idle."""
        self.snapshot_subscribers += delta
        self._send(("subscribers", self.snapshot_subscribers))

    @property
    def is_running(self) -> bool:
        return self._started and self._dead is None and self._runner.alive()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; must be called from the event loop that will consume outputs."""
        if self._started:
            return
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        self._loop = asyncio.get_running_loop()
        self._started = True
        self._runner.start(self._loop, self._on_message)

    async def shutdown(self) -> None:
        """Abort every request, stop the loop and release the engine."""
        if not self._started:
            if self._dead is None:  # never started: nothing is in flight
                self._dead = EngineDeadError("engine was shut down")
                self._runner.close()
            return
        self._send(("stop",))
        await asyncio.to_thread(self._runner.join)
        await asyncio.sleep(0)   # the loop's last messages ("dead") were queued before it ended
        if self._dead is None:
            self._on_message(("dead", EngineDeadError("engine was shut down")))

    def pause(self) -> None:
        """Stop stepping; adds and aborts are still applied (requests queue up as waiting)."""
        self._send(("pause",))

    def resume(self) -> None:
        self._send(("resume",))

    def _send(self, command: tuple) -> None:
        if self._dead is None:
            self._runner.send(command)

    # ---- requests ----------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                          priority: int = 0, arrival_time: float | None = None, lora_request=None) -> RequestStream:
        """Admit a request and return its output stream.

        Raises what `LLMEngine.add_request` raises (ValueError for bad input, SchedulerFullError
        when the waiting queue is full) before any output is produced.
        """
        if not self._started:
            self.start()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        token, admitted = self._expect()
        self._runner.send(("add", token, request_id, prompt, params, priority, arrival_time, lora_request))
        try:
            await admitted
        except asyncio.CancelledError:
            stream.close()  # the add is already queued; the abort queued behind it undoes it
            raise
        except BaseException:
            stream.finished = True
            self._forget(request_id)
            raise
        return stream

    async def call(self, method: str, *args) -> Any:
        """`engine.<method>(*args)` in the engine loop, between steps (LoRA adapters: add_lora, remove_lora,
        list_loras); raises what it raises."""
        if not self._started:
            self.start()
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        token, done = self._expect()
        self._runner.send(("call", token, method, args))
        return await done

    def _expect(self) -> tuple[int, asyncio.Future]:
        token = next(self._tokens)
        future = self._pending[token] = self._loop.create_future()
        return token, future

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes; stopping early aborts it."""
        stream = await self.add_request(request_id, prompt, params, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed by the loop."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids:
            self._send(("abort", ids))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ---- event-loop side of the loop's messages -------------------------------------------------
    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            _, outputs, self._stats = message
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue  # consumer already gone; the abort is on its way
                stream.put(output)
                if output.finished:
                    self._forget(output.request_id)
        elif kind == "stats":
            self._stats = message[1]
        elif kind == "resolved":
            _, token, result, error = message
            future = self._pending.pop(token, None)
            if future is not None and not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)
        elif kind == "snapshot":
            _, self._snapshot, self._snapshot_interval = message
        elif kind == "dead" and self._dead is None:
            error = message[1]
            self._dead = error
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(EngineDeadError(f"engine is not running: {error}"))
            self._pending.clear()
            for stream in list(self._streams.values()):
                stream.put(error)
            self._streams.clear()
