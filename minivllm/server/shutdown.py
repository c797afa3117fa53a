"""Graceful shutdown: SIGTERM drains the server before uvicorn stops it.

On the first SIGTERM the app starts draining: API routes and the dashboard answer 503 (an OpenAI error
with Retry-After), /health turns 503 so balancers stop routing here, and requests already running are
left to finish. Once none is in flight, or after `shutdown_timeout` seconds, uvicorn's own shutdown
runs: connections close, the lifespan stops the engine and aborts whatever is left. The process then
exits 0. A second SIGTERM, or Ctrl-C, stops at once as uvicorn normally does.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

logger = logging.getLogger(__name__)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float = 30.0) -> None:
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        state = getattr(self.config.app, "state", None)
        if sig != signal.SIGTERM or state is None or state.draining or self.should_exit:
            return super().handle_exit(sig, frame)
        # Runs in the main thread between bytecodes of the event loop: only flip flags and schedule.
        state.draining = True
        logger.info("SIGTERM: draining (no new requests; up to %.0f s for running ones)", self.shutdown_timeout)
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._start_drain, state)

    def _start_drain(self, state) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(state))

    async def _drain(self, state) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        engine = state.engine
        while time.monotonic() < deadline and (state.num_api_requests > 0 or engine.num_streams > 0):
            await asyncio.sleep(0.05)
        if state.num_api_requests or engine.num_streams:
            logger.warning("shutdown timeout: aborting %d requests still running", engine.num_streams)
        else:
            logger.info("drained: every running request finished")
        self.should_exit = True
