"""The engine loop in a process of its own (engine/engine_process.py), on the CPU with a paced engine: messages
larger than the pipe's buffer reach the server whole under uvloop, which uvicorn uses where it is installed and
which makes a polled descriptor non-blocking."""
from __future__ import annotations

import asyncio

import uvloop

from bench.server_overhead import build_paced_engine
from minivllm.engine.async_engine import AsyncEngine
from minivllm.sampling_params import SamplingParams


def test_messages_larger_than_the_pipe_arrive_whole_under_uvloop():
    engine = AsyncEngine.spawn(0.001, build=build_paced_engine)
    prompt = list(range(300_000))   # every output carries it: each message is about 1 MB

    async def main():
        engine.start()
        try:
            return [out async for out in engine.generate(prompt, SamplingParams(max_tokens=6), "big")]
        finally:
            await engine.shutdown()

    outputs = uvloop.run(asyncio.wait_for(main(), timeout=60))
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [1000 + i for i in range(6)]
    assert outputs[-1].prompt_token_ids == prompt
