"""The live dashboard: GET /dashboard (one static page), /dashboard/events (SSE) and /dashboard/snapshot.

The engine loop takes the snapshot (queues and KV pool as plain data) between steps, at most every
`AsyncEngine.SNAPSHOT_INTERVAL_S` and only while a page is subscribed; this module only reads the
latest one and adds rolling figures computed from the engine counters and the server's recent
TTFT/ITL samples. Nothing here runs on the engine thread.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from minivllm.server.serving_engine import EventStreamResponse, sse

STATIC = Path(__file__).parent / "static"
WINDOW_S = 10.0  # percentiles and rates cover the last this many seconds


def _percentiles(samples, since: float) -> dict[str, float | None]:
    values = np.array([v for t, v in list(samples) if t >= since])
    if values.size == 0:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]) * 1e3
    return {"p50": round(float(p50), 2), "p90": round(float(p90), 2), "p99": round(float(p99), 2)}


class RollingStats:
    """Rates over the last WINDOW_S seconds from the engine's cumulative counters."""

    def __init__(self) -> None:
        self.history: list[tuple[float, int, int, int]] = []  # (time, tokens, prefix queries, prefix hits)

    def update(self, stats, now: float) -> dict:
        tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        self.history.append((now, tokens, stats.prefix_cache_queries, stats.prefix_cache_hits))
        while len(self.history) > 2 and self.history[1][0] < now - WINDOW_S:
            self.history.pop(0)
        t0, tokens0, queries0, hits0 = self.history[0]
        elapsed = now - t0
        queries = stats.prefix_cache_queries - queries0
        return {"tokens_per_s": round((tokens - tokens0) / elapsed, 1) if elapsed > 0 else 0.0,
                "prefix_hit_rate": round((stats.prefix_cache_hits - hits0) / queries, 4) if queries else None}


def event(engine, metrics, rolling: RollingStats) -> dict:
    now = time.monotonic()
    stats = engine.get_stats()
    return {"time": now, "snapshot": engine.get_snapshot(), "batch_size": stats.num_running,
            "kv_cache_usage": round(stats.kv_cache_usage, 4), "num_preemptions": stats.num_preemptions,
            "ttft_ms": _percentiles(metrics.recent_ttft, now - WINDOW_S),
            "itl_ms": _percentiles(metrics.recent_itl, now - WINDOW_S), **rolling.update(stats, now)}


def install(app: FastAPI, engine, metrics) -> None:
    polled = RollingStats()  # rates between successive polls of /dashboard/snapshot

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html", media_type="text/html")

    @app.get("/dashboard/snapshot")
    async def dashboard_snapshot() -> JSONResponse:
        """The latest engine snapshot and rolling figures (a snapshot is taken while this is polled)."""
        asked = time.monotonic()
        engine.subscribe_snapshots(+1)
        try:  # a fresh one: the loop takes it after its current step (or at once when idle)
            while engine.is_running and time.monotonic() < asked + 30:
                snapshot = engine.get_snapshot()
                if snapshot is not None and snapshot["time"] >= asked:
                    break
                await asyncio.sleep(0.02)
        finally:
            engine.subscribe_snapshots(-1)
        return JSONResponse(event(engine, metrics, polled))

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(request: Request) -> EventStreamResponse:
        async def stream():
            engine.subscribe_snapshots(+1)
            rolling = RollingStats()
            try:
                while not app.state.draining and engine.is_running:
                    yield sse(json.dumps(event(engine, metrics, rolling)))
                    await asyncio.sleep(engine.snapshot_interval)  # no event without a new snapshot
            finally:
                engine.subscribe_snapshots(-1)
        return EventStreamResponse(stream())
