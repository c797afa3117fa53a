"""AsyncEngine's background loop, driven by a scripted engine (no model) so every interleaving is exact.

The fake emits one token per step per request and records every call with the calling thread, so
the tests check the invariants that matter: one engine thread only, abort on cancel, errors
surface at admission, no spinning while idle, shutdown and crashes release every waiter.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from minivllm.core.scheduler import SchedulerFullError
from minivllm.engine.async_engine import AsyncEngine, EngineDeadError
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams


@dataclass
class Stats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


class ScriptedEngine:
    """Each request produces tokens 0, 1, 2, ... one per step, until params.max_tokens."""

    model_name = "scripted"
    max_model_len = 64
    tokenizer = None

    def __init__(self, max_waiting: int | None = None, step_delay: float = 0.0, crash_at_step: int | None = None):
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: list[str] = []
        self.threads: set[int] = set()
        self.calls: list[str] = []
        self.num_steps = 0
        self.num_idle_checks = 0
        self.max_waiting = max_waiting
        self.step_delay = step_delay
        self.crash_at_step = crash_at_step
        self.shut_down = False

    def _enter(self, name: str) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(name)

    def add_request(self, request_id, prompt, params, *, arrival_time=None, priority=0) -> None:
        self._enter("add")
        if not prompt:
            raise ValueError("the prompt is empty")
        if self.max_waiting is not None and len(self.requests) >= self.max_waiting:
            raise SchedulerFullError("queue full")
        self.requests[request_id] = ([], params)

    def abort_request(self, request_id) -> None:
        self._enter("abort")
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        self.threads.add(threading.get_ident())
        if not self.requests:
            self.num_idle_checks += 1
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._enter("step")
        self.num_steps += 1
        if self.crash_at_step is not None and self.num_steps >= self.crash_at_step:
            raise RuntimeError("boom")
        time.sleep(self.step_delay)
        outputs = []
        for rid, (tokens, params) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= params.max_tokens
            outputs.append(RequestOutput(rid, None, [1], [CompletionOutput(
                0, "", list(tokens), finish_reason="length" if done else None)], finished=done))
            if done:
                del self.requests[rid]
        return outputs

    def get_stats(self) -> Stats:
        return Stats(num_running=len(self.requests))

    def shutdown(self) -> None:
        self._enter("shutdown")
        self.shut_down = True


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


def test_streams_cumulative_outputs_from_one_engine_thread():
    fake = ScriptedEngine()

    async def main():
        engine = AsyncEngine(fake)
        engine.start()

        async def one(rid: str, n: int) -> list[int]:
            last = None
            async for out in engine.generate([1, 2], SamplingParams(max_tokens=n), rid):
                last = out
            assert last.finished and last.outputs[0].finish_reason == "length"
            return last.outputs[0].token_ids

        results = await asyncio.gather(one("a", 3), one("b", 5), one("c", 1))
        await engine.shutdown()
        return results

    assert run(main()) == [[0, 1, 2], [0, 1, 2, 3, 4], [0]]
    assert len(fake.threads) == 1 and threading.get_ident() not in fake.threads
    assert fake.shut_down and fake.aborted == []


def test_the_engine_loop_runs_with_the_heap_frozen_and_hands_it_back_at_shutdown():
    """Full collections while serving skip the heap loaded before (gc.freeze, see engine/gc_heap.py); the
    heap is unfrozen once the loop stops, so what it held can be collected again."""
    import gc
    fake = ScriptedEngine()
    frozen_at_step = []
    step = fake.step
    fake.step = lambda: frozen_at_step.append(gc.get_freeze_count()) or step()

    async def main():
        engine = AsyncEngine(fake)
        engine.start()
        [out async for out in engine.generate([1], SamplingParams(max_tokens=3), "a")]
        await engine.shutdown()

    run(main())
    assert len(frozen_at_step) == 3 and min(frozen_at_step) > 1000   # asyncio, pytest, the engine ...
    assert gc.get_freeze_count() == 0


def test_admission_errors_surface_to_the_caller_and_the_loop_keeps_serving():
    # "a" stays queued for 20 slow steps, so "b" meets a full queue however late the test thread runs.
    fake = ScriptedEngine(max_waiting=1, step_delay=0.02)

    async def main():
        engine = AsyncEngine(fake)
        engine.start()
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("bad", [], SamplingParams())
        first = await engine.add_request("a", [1], SamplingParams(max_tokens=20))
        with pytest.raises(SchedulerFullError):
            await engine.add_request("b", [1], SamplingParams(max_tokens=2))
        outputs = [out async for out in first]
        assert outputs[-1].finished
        again = [out async for out in engine.generate([1], SamplingParams(max_tokens=2), "b")]
        assert again[-1].outputs[0].token_ids == [0, 1]
        assert engine.num_streams == 0  # no stream leaks, rejected ones included
        await engine.shutdown()

    run(main())


def test_consumer_that_stops_early_aborts_its_request():
    fake = ScriptedEngine(step_delay=0.005)

    async def main():
        engine = AsyncEngine(fake)
        engine.start()
        # Closing the generator (client hung up) ...
        gen = engine.generate([1], SamplingParams(max_tokens=1000), "closed")
        await gen.__anext__()
        await gen.aclose()

        # ... and cancelling the task that iterates it both abort the request.
        async def consume():
            async for _ in engine.generate([1], SamplingParams(max_tokens=1000), "cancelled"):
                pass

        task = asyncio.create_task(consume())
        while fake.num_steps < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while fake.requests:
            await asyncio.sleep(0.005)
        await engine.shutdown()

    run(main())
    assert sorted(fake.aborted) == ["cancelled", "closed"]
    assert fake.num_steps < 1000


def test_idle_loop_sleeps_and_pause_holds_requests_waiting():
    fake = ScriptedEngine()

    async def main():
        engine = AsyncEngine(fake)
        engine.start()
        await asyncio.sleep(0.3)
        # A spinning loop would have checked for work thousands of times by now.
        assert fake.num_idle_checks <= 3 and fake.num_steps == 0
        engine.pause()
        stream = await engine.add_request("a", [1], SamplingParams(max_tokens=2))
        await asyncio.sleep(0.2)
        assert fake.num_steps == 0 and engine.get_stats().num_running == 1
        engine.resume()
        outputs = [out async for out in stream]
        assert outputs[-1].outputs[0].token_ids == [0, 1]
        await engine.shutdown()

    run(main())


def test_shutdown_aborts_running_requests_and_rejects_new_ones():
    fake = ScriptedEngine(step_delay=0.005)

    async def main():
        engine = AsyncEngine(fake)
        engine.start()
        stream = await engine.add_request("a", [1], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", [1], SamplingParams())
        assert not engine.is_running

    run(main())
    assert fake.aborted == ["a"] and fake.shut_down


def test_engine_crash_fails_streams_instead_of_hanging():
    fake = ScriptedEngine(crash_at_step=2)

    async def main():
        engine = AsyncEngine(fake)
        engine.start()
        stream = await engine.add_request("a", [1], SamplingParams(max_tokens=5))
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", [1], SamplingParams())
        await engine.shutdown()

    run(main())
