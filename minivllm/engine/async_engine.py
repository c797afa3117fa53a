"""AsyncEngine: the LLMEngine driven by one background thread, with one async stream per request.

Owns the engine loop thread and the per-request output queues. The `LLMEngine` is touched only from
that thread: coroutines hand it commands (add, abort, pause, resume, stop) through a FIFO queue, so
an abort sent after an add is always applied after it, and the engine never sees two threads.
Outputs travel back to the event loop with `call_soon_threadsafe`, once per step.

Does not know about HTTP; the server talks only to this class.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from minivllm.engine.gc_heap import frozen_heap
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or a crash in `step`); no request can be served."""


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


class AsyncEngine:
    """Runs `engine.step()` in a background thread while requests stream through asyncio queues."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._paused = False
        self._dead: BaseException | None = None
        self._dead_lock = threading.Lock()  # orders "is it dead?" + enqueue against the loop's exit
        self._live_ids: set[str] = set()    # engine-thread view of admitted, unfinished requests
        self._stats = engine.get_stats()
        # Dashboard: while anyone subscribes, the loop snapshots queues and KV pool between steps, at
        # most every SNAPSHOT_INTERVAL_S and never more than 0.25% of its time (a snapshot is O(blocks): a
        # pool of 30k blocks takes 2 ms on the H100 host, so it is then taken under twice a second; at a 1%
        # share W1 through the server lost 1.8%, dashboard_cost_h100_1pct.json); nobody subscribed, no cost.
        self.snapshot_subscribers = 0
        self._snapshot: dict | None = None
        self._snapshot_time = 0.0
        self._snapshot_interval = self.SNAPSHOT_INTERVAL_S

    @classmethod
    def from_config(cls, config: Any) -> AsyncEngine:
        from minivllm.engine.llm_engine import LLMEngine
        return cls(LLMEngine(config))

    # ---- what the server reads -------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def quantization(self) -> str | None:
        return self.engine.quantization

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.engine, "vocab_size", None)

    @property
    def config(self) -> Any:
        return getattr(self.engine, "config", None)

    def get_stats(self) -> Any:
        """The engine stats as of the end of the last step or command batch (never blocks)."""
        return self._stats

    SNAPSHOT_INTERVAL_S = 0.1

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
        if delta > 0:
            self._commands.put(("snapshot",))

    def _maybe_snapshot(self) -> None:
        now = time.monotonic()
        if self.snapshot_subscribers > 0 and now - self._snapshot_time >= self._snapshot_interval:
            snapshot = self.engine.snapshot()
            cost = time.monotonic() - now
            self._snapshot_interval = max(self.SNAPSHOT_INTERVAL_S, 400 * cost)
            snapshot["time"] = now
            self._snapshot, self._snapshot_time = snapshot, now

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; must be called from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort every request, stop the loop and release the engine."""
        if self._thread is None:
            if self._dead is None:  # never started: nothing is in flight
                self._dead = EngineDeadError("engine was shut down")
                self.engine.shutdown()
            return
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join)

    def pause(self) -> None:
        """Stop stepping; adds and aborts are still applied (requests queue up as waiting)."""
        self._commands.put(("pause",))

    def resume(self) -> None:
        self._commands.put(("resume",))

    # ---- requests ----------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                          priority: int = 0, arrival_time: float | None = None, lora_request=None) -> RequestStream:
        """Admit a request and return its output stream.

        Raises what `LLMEngine.add_request` raises (ValueError for bad input, SchedulerFullError
        when the waiting queue is full) before any output is produced.
        """
        if self._thread is None:
            self.start()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        admitted: asyncio.Future[None] = self._loop.create_future()
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        with self._dead_lock:
            if self._dead is not None:
                raise EngineDeadError(f"engine is not running: {self._dead}")
            stream = RequestStream(request_id, self)
            self._streams[request_id] = stream
            self._commands.put(("add", request_id, prompt, params, priority, arrival_time, lora_request, admitted))
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
        """`engine.<method>(*args)` on the engine thread, between steps (LoRA adapters: add_lora, remove_lora,
        list_loras); raises what it raises."""
        if self._thread is None:
            self.start()
        done: asyncio.Future = self._loop.create_future()
        with self._dead_lock:
            if self._dead is not None:
                raise EngineDeadError(f"engine is not running: {self._dead}")
            self._commands.put(("call", method, args, done))
        return await done

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
            self._commands.put(("abort", ids))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ---- event-loop side of delivery -----------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # consumer already gone; the abort is on its way
            stream.put(output)
            if output.finished:
                self._forget(output.request_id)

    def _resolve(self, future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    @staticmethod
    def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put(error)
        self._streams.clear()

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with frozen_heap():   # full collections skip the heap loaded before serving (gc_heap.py)
                self._loop_until_stopped()
            error: BaseException = EngineDeadError("engine was shut down")
        except BaseException as e:  # a bug in the engine: fail every request, report it, stay dead
            logger.exception("engine loop crashed")
            error = EngineDeadError(f"engine loop crashed: {e!r}")
        with self._dead_lock:
            self._dead = error
        try:
            self._reject_pending(error)
            self._loop.call_soon_threadsafe(self._fail_all, error)
        except RuntimeError:  # the event loop is already closed: nobody is waiting any more
            pass
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")

    def _loop_until_stopped(self) -> None:
        while True:
            # Sleep on the command queue when there is nothing to step: no busy spinning.
            idle = self._paused or not self.engine.has_unfinished_requests()
            if self._apply_commands(block=idle):
                return
            if self._paused or not self.engine.has_unfinished_requests():
                self._stats = self.engine.get_stats()  # adds/aborts changed it; no step will refresh it
                self._snapshot_time = 0.0  # idle: the next snapshot is the last word until work arrives
                self._maybe_snapshot()
                continue
            outputs = self.engine.step()
            self._stats = self.engine.get_stats()
            self._maybe_snapshot()
            for output in outputs:
                if output.finished:
                    self._live_ids.discard(output.request_id)
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); True when asked to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return False
        while True:
            if self._apply(command):
                return True
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return False

    def _apply(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, priority, arrival_time, lora_request, admitted = command
            error = None
            try:
                extra = {} if lora_request is None else {"lora_request": lora_request}
                self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time,
                                        priority=priority, **extra)
                self._live_ids.add(request_id)
            except Exception as e:  # bad input or admission control: the caller decides the status
                error = e
            self._loop.call_soon_threadsafe(self._resolve, admitted, error)
        elif kind == "call":
            _, method, args, done = command
            try:
                result, error = getattr(self.engine, method)(*args), None
            except Exception as e:   # bad input: the caller answers it
                result, error = None, e
            self._loop.call_soon_threadsafe(self._settle, done, result, error)
        elif kind == "abort":
            self.engine.abort_request(command[1])
            self._live_ids.difference_update(command[1])
        elif kind == "pause":
            self._paused = True
        elif kind == "resume":
            self._paused = False
        elif kind == "snapshot":
            self._snapshot_time = 0.0
            self._maybe_snapshot()
        elif kind == "stop":
            self._abort_all()
            return True
        return False

    def _abort_all(self) -> None:
        if self._live_ids:
            self.engine.abort_request(sorted(self._live_ids))
            self._live_ids.clear()

    def _reject_pending(self, error: BaseException) -> None:
        """Fail adds still queued after the loop ended, so no caller waits forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] in ("add", "call"):
                self._loop.call_soon_threadsafe(self._resolve, command[-1],
                                                EngineDeadError(f"engine is not running: {error}"))
