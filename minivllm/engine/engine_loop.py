"""EngineLoop: the side of `AsyncEngine` that owns the `LLMEngine`, in a thread of the server's process or in a
process of its own (engine/engine_process.py).

It applies commands between steps, steps while there is work and emits messages; it never sees asyncio.
Commands (tuples, in order): ("add", token, request_id, prompt, params, priority, arrival_time, lora_request),
("call", token, method, args), ("abort", ids), ("pause",), ("resume",), ("subscribers", count), ("stop",).
Messages: ("outputs", outputs, stats) after each step, ("stats", stats) after commands changed them
while nothing steps, ("resolved", token, result, error) for an add or a call, ("snapshot", snapshot, interval)
for the dashboard and, last, ("dead", error).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from minivllm.engine.gc_heap import frozen_heap

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or a crash in `step`); no request can be served."""


class EngineLoop:
    def __init__(self, engine: Any, next_command: Callable[[bool], tuple | None], emit: Callable[[tuple], None]):
        """`next_command(block)`: the next command, waiting for one if `block`, else None when there is none."""
        self.engine = engine
        self.next_command = next_command
        self.emit = emit
        self.paused = False
        self.live_ids: set[str] = set()   # admitted, unfinished requests (aborted all at stop)
        # Dashboard: while anyone subscribes, the loop snapshots queues and KV pool between steps, at most every
        # SNAPSHOT_INTERVAL_S and never more than 0.25% of its time (a snapshot is O(blocks): a pool of 30k
        # blocks takes 2 ms on the H100 host, so it is then taken under twice a second; at a 1% share W1
        # through the server lost 1.8%, dashboard_cost_h100_1pct.json); nobody subscribed, no cost.
        self.subscribers = 0
        self.snapshot_time = 0.0
        self.snapshot_interval = SNAPSHOT_INTERVAL_S

    def run(self) -> None:
        """Serve commands and steps until "stop" (or a crash); then report "dead" and release the engine."""
        try:
            with frozen_heap():   # full collections skip the heap loaded before serving (gc_heap.py)
                self._loop_until_stopped()
            error: BaseException = EngineDeadError("engine was shut down")
        except BaseException as e:  # a bug in the engine: fail every request, report it, stay dead
            logger.exception("engine loop crashed")
            error = EngineDeadError(f"engine loop crashed: {e!r}")
        try:
            self.emit(("dead", error))
        finally:
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _loop_until_stopped(self) -> None:
        engine = self.engine
        while True:
            # Sleep on the commands when there is nothing to step: no busy spinning.
            idle = self.paused or not engine.has_unfinished_requests()
            if self._apply_commands(block=idle):
                return
            if self.paused or not engine.has_unfinished_requests():
                self.emit(("stats", engine.get_stats()))   # adds/aborts changed them; no step will
                self.snapshot_time = 0.0  # idle: the next snapshot is the last word until work arrives
                self._maybe_snapshot()
                continue
            outputs = engine.step()
            for output in outputs:
                if output.finished:
                    self.live_ids.discard(output.request_id)
            self.emit(("outputs", outputs, engine.get_stats()))
            self._maybe_snapshot()

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); True when asked to stop."""
        command = self.next_command(block)
        while command is not None:
            if self._apply(command):
                return True
            command = self.next_command(False)
        return False

    def _apply(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "add":
            _, token, request_id, prompt, params, priority, arrival_time, lora_request = command
            error = None
            try:
                extra = {} if lora_request is None else {"lora_request": lora_request}
                self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time,
                                        priority=priority, **extra)
                self.live_ids.add(request_id)
            except Exception as e:  # bad input or admission control: the caller decides the status
                error = e
            self.emit(("resolved", token, None, error))
        elif kind == "call":
            _, token, method, args = command
            try:
                result, error = getattr(self.engine, method)(*args), None
            except Exception as e:   # bad input: the caller answers it
                result, error = None, e
            self.emit(("resolved", token, result, error))
        elif kind == "abort":
            self.engine.abort_request(command[1])
            self.live_ids.difference_update(command[1])
        elif kind == "pause":
            self.paused = True
        elif kind == "resume":
            self.paused = False
        elif kind == "subscribers":
            more = command[1] > self.subscribers
            self.subscribers = command[1]
            if more:   # a new subscriber gets a snapshot even when idle
                self.snapshot_time = 0.0
                self._maybe_snapshot()
        elif kind == "stop":
            if self.live_ids:
                self.engine.abort_request(sorted(self.live_ids))
                self.live_ids.clear()
            return True
        return False

    def _maybe_snapshot(self) -> None:
        now = time.monotonic()
        if self.subscribers > 0 and now - self.snapshot_time >= self.snapshot_interval:
            snapshot = self.engine.snapshot()
            cost = time.monotonic() - now
            self.snapshot_interval = max(SNAPSHOT_INTERVAL_S, 400 * cost)
            snapshot["time"] = now
            self.snapshot_time = now
            self.emit(("snapshot", snapshot, self.snapshot_interval))
