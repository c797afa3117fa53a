"""EngineProcess: the EngineLoop in a process of its own, so the engine's host work never waits for the server's
GIL (async_engine.py says why), and the server's side of it.

The server's process spawns it and sends commands down a pipe; the engine process builds the engine, says where
its tokenizer is as soon as it knows (the server loads its own copy while the weights load), then "ready" with
the engine's `EngineInfo` and first stats, and runs the loop. Each message is pickled by the loop and written by
a sender thread, so a step never waits on the pipe. In the server's process the event loop itself reads the
pipe (`add_reader`): messages are applied between the chunks it writes, in order, and no other thread of the
server competes with it for the GIL to hand them over. The server's heap is frozen for garbage collection while
it serves (engine/gc_heap.py), as the engine's is.

The engine process ignores Ctrl-C (the server stops it in order) and stops when the server's end of the pipe
closes; an engine process that dies is reported as a dead engine at once (the pipe ends), never a hang.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from minivllm.engine.engine_loop import EngineDeadError, EngineLoop
from minivllm.engine.gc_heap import frozen_heap
from minivllm.engine.stats import EngineInfo

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0   # for the engine process to end after "stop" (it aborts requests, frees the device)


def _dumps(message: tuple) -> bytes:
    """Pickle a message; an error that does not pickle (an exception class with extra arguments) travels
    as a RuntimeError with its text."""
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        clean = tuple(RuntimeError(f"{type(x).__name__}: {x}") if isinstance(x, BaseException) else x
                      for x in message)
        return pickle.dumps(clean, protocol=pickle.HIGHEST_PROTOCOL)


def build_llm_engine(config: Any, tokenizer_dir: Callable[[str | None], None], spawned_at: float) -> Any:
    """The LLMEngine for `config`, telling `tokenizer_dir` where its tokenizer is before the weights load.
    `spawned_at`: the server's `time.time()` at the spawn (the "engine_imports" phase runs from there)."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.models.loader import resolve_model
    imported = time.time() - spawned_at
    started = time.perf_counter()
    source = resolve_model(config.model, config.load_format)
    resolved = time.perf_counter() - started
    tokenizer_dir(None if config.skip_tokenizer_init else config.tokenizer or source.tokenizer_dir)
    engine = LLMEngine(config, source)
    engine.startup_seconds.update(engine_imports=imported, resolve_model=resolved)
    return engine


def _engine_main(build: Callable, config: Any, conn, spawned_at: float) -> None:
    """The engine process: build the engine, report ready (or the error), serve the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = build(config, lambda path: conn.send_bytes(_dumps(("tokenizer_dir", path))), spawned_at)
    except BaseException as e:
        conn.send_bytes(_dumps(("failed", e)))
        return
    conn.send_bytes(_dumps(("ready", EngineInfo.of(engine), engine.get_stats())))

    outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def write() -> None:   # the pipe's writes, off the loop's thread (a full pipe blocks only this thread)
        while (data := outbox.get()) is not None:
            try:
                conn.send_bytes(data)
            except OSError:   # the server is gone
                return

    sender = threading.Thread(target=write, name="minivllm-engine-sender", daemon=True)
    sender.start()

    def next_command(block: bool) -> tuple | None:
        if not block and not conn.poll(0):
            return None
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):   # the server's process ended: stop, aborting what runs
            return ("stop",)

    try:
        EngineLoop(engine, next_command, lambda message: outbox.put(_dumps(message))).run()
    finally:
        outbox.put(None)
        sender.join(timeout=STOP_TIMEOUT_S)


class EngineProcess:
    """The server's side: spawn, wait for ready, send commands, read messages (for AsyncEngine). `build`: a
    module-level function (config, tokenizer_dir callback, spawned_at) -> engine, run in the engine process."""

    def __init__(self, config: Any, build: Callable = build_llm_engine) -> None:
        context = multiprocessing.get_context("spawn")   # CUDA cannot be forked
        self.conn, child = context.Pipe(duplex=True)
        # Not a daemon: an engine with tensor parallelism starts processes of its own.
        self.process = context.Process(target=_engine_main, args=(build, config, child, time.time()),
                                       name="minivllm-engine", daemon=False)
        self.process.start()
        child.close()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: Callable[[tuple], None] | None = None
        self._heap = contextlib.ExitStack()
        self._send_lock = threading.Lock()
        atexit.register(self._end)

    def _recv(self) -> tuple:
        while not self.conn.poll(0.5):
            if not self.process.is_alive():
                raise EngineDeadError(f"the engine process exited with code {self.process.exitcode} "
                                      "before it was ready")
        return pickle.loads(self.conn.recv_bytes())

    def wait_ready(self) -> tuple[Any, EngineInfo, Any]:
        """(tokenizer, info, first stats) once the engine is built; raises what building it raised."""
        tokenizer = None
        try:
            while True:
                message = self._recv()
                if message[0] == "tokenizer_dir":
                    if message[1] is not None:
                        from minivllm.engine.tokenizer import load_tokenizer
                        tokenizer = load_tokenizer(message[1])
                elif message[0] == "ready":
                    return tokenizer, message[1], message[2]
                else:   # "failed"
                    raise message[1]
        except BaseException:
            self._end()
            raise

    def start(self, loop: asyncio.AbstractEventLoop, handle: Callable[[tuple], None]) -> None:
        """Hand every message to `handle` from `loop`'s own thread, as the pipe becomes readable."""
        self._loop, self._handle = loop, handle
        self._heap.enter_context(frozen_heap())
        loop.add_reader(self.conn.fileno(), self._read)
        # uvloop (uvicorn's loop where it is installed) makes a polled descriptor non-blocking; this pipe's reads
        # and writes are whole messages, which must not stop half-way.
        os.set_blocking(self.conn.fileno(), True)

    def _read(self) -> None:
        try:
            while self.conn.poll(0):
                message = pickle.loads(self.conn.recv_bytes())
                self._handle(message)
                if message[0] == "dead":
                    self._stop_reading()
                    return
        except (EOFError, OSError):
            self._stop_reading()
            self.process.join(timeout=5.0)
            self._handle(("dead", EngineDeadError(f"the engine process exited (code {self.process.exitcode})")))

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.conn.fileno())
        self._heap.close()

    def send(self, command: tuple) -> None:
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
        except OSError:   # the engine process is gone; the reader reports it
            pass

    def alive(self) -> bool:
        return self.process.is_alive()

    def join(self) -> None:
        """Wait for the engine process to end after "stop" (killed past STOP_TIMEOUT_S). Called off the event
        loop (asyncio.to_thread): the loop goes on reading the last messages meanwhile."""
        self.process.join(timeout=STOP_TIMEOUT_S)
        self._end()

    def close(self) -> None:
        """Never started: stop it."""
        self.send(("stop",))
        self.join()

    def _end(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
