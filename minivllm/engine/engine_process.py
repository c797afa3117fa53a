"""EngineProcess: the EngineLoop in a process of its own, so the engine's host work never waits for the server's
GIL (async_engine.py says why), and the server's side of it.

The server's process spawns it and sends commands down a pipe; the engine process builds the LLMEngine, says
where its tokenizer is as soon as it knows (the server loads its own copy while the weights load), then
"ready" with the engine's `EngineInfo` and first stats, and runs the loop. Each message is pickled by the
loop and written by a sender thread, so a step never waits on the pipe; a reader thread in the server's
process unpickles it and hands it to the event loop. The engine process ignores Ctrl-C (the server stops
it in order) and stops when the server's end of the pipe closes; an engine process that dies is reported as
a dead engine at once (the pipe ends), never a hang.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from typing import Any

from minivllm.engine.async_engine import EngineInfo
from minivllm.engine.engine_loop import EngineDeadError, EngineLoop

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


def _engine_main(config: Any, conn, spawned_at: float) -> None:
    """The engine process: build the engine, report ready (or the error), serve the loop. `spawned_at`: the
    server's `time.time()` when it started this process (the engine's "engine_imports" phase runs from there)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from minivllm.engine.llm_engine import LLMEngine
        from minivllm.models.loader import resolve_model
        imported = time.time() - spawned_at
        started = time.perf_counter()
        source = resolve_model(config.model, config.load_format)
        resolved = time.perf_counter() - started
        conn.send_bytes(_dumps(("tokenizer_dir", None if config.skip_tokenizer_init
                                else config.tokenizer or source.tokenizer_dir)))
        engine = LLMEngine(config, source)
        engine.startup_seconds.update(engine_imports=imported, resolve_model=resolved)
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
    """The server's side: spawn, wait for ready, send commands, read messages (for AsyncEngine)."""

    def __init__(self, config: Any) -> None:
        context = multiprocessing.get_context("spawn")   # CUDA cannot be forked
        self.conn, child = context.Pipe(duplex=True)
        # Not a daemon: an engine with tensor parallelism starts processes of its own.
        self.process = context.Process(target=_engine_main, args=(config, child, time.time()),
                                       name="minivllm-engine", daemon=False)
        self.process.start()
        child.close()
        self.reader: threading.Thread | None = None
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

    def start(self, on_message) -> None:
        self.reader = threading.Thread(target=self._read, args=(on_message,), name="minivllm-engine-reader",
                                       daemon=True)
        self.reader.start()

    def _read(self, on_message) -> None:
        try:
            while True:
                message = pickle.loads(self.conn.recv_bytes())
                on_message(message)
                if message[0] == "dead":
                    return
        except (EOFError, OSError):
            self.process.join(timeout=5.0)
            on_message(("dead", EngineDeadError(f"the engine process exited (code {self.process.exitcode})")))

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
        """Wait for the engine process to end after "stop" (killed past STOP_TIMEOUT_S), and for the reader."""
        self.process.join(timeout=STOP_TIMEOUT_S)
        self._end()
        if self.reader is not None:
            self.reader.join(timeout=5.0)

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
