"""What an open dashboard costs: serving throughput with and without a /dashboard/events subscriber.

Starts `minivllm serve`, then runs a W1-shaped load through the server (64 requests x 512 random prompt
ids x 256 output tokens, all in flight at once, ignore_eos) alternately without and with one client
reading the dashboard's event stream, `--repeats` times each, and reports the output-token throughput
of both and the relative cost (target: at most 1%). Also times `BlockManager.snapshot()` on a pool the
size of the server's, half in use.

    python bench/dashboard_cost.py --model llama-3-8b --load-format dummy --out $OUT
    python bench/dashboard_cost.py --num-prompts 8 --input-len 32 --output-len 16 --concurrency 8   # CPU smoke
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout
from bench.common import git_commit, run_command  # noqa: E402
from bench.serve import (device_name, device_tag, free_port, run_level, start_server, stop_server,  # noqa: E402
                         wait_healthy)
from minivllm.core.block_manager import BlockManager  # noqa: E402


async def subscriber(url: str, stop: asyncio.Event, counts: dict) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        async with http.get(url + "/dashboard/events") as response:
            async for line in response.content:
                if line.startswith(b"data: "):
                    counts["events"] += 1
                if stop.is_set():
                    return


async def measure(args, url: str) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        async with http.get(url + "/dashboard/snapshot") as response:
            num_blocks = (await response.json())["snapshot"]["kv"]["num_blocks"]
    rng = random.Random(args.seed)

    def fresh_workload(num_prompts: int) -> list:
        # New prompts for every run: a repeated prompt would hit the prefix cache and skip its prefill.
        return [([rng.randint(100, 20000) for _ in range(args.input_len)], args.output_len)
                for _ in range(num_prompts)]
    await run_level(url, model, fresh_workload(max(1, args.concurrency // 4)), args.concurrency, None, {}, 600, 0)
    runs = {"off": [], "on": []}
    events = []
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            workload = fresh_workload(args.num_prompts)
            stop, counts, task = asyncio.Event(), {"events": 0}, None
            if mode == "on":
                task = asyncio.create_task(subscriber(url, stop, counts))
                await asyncio.sleep(0.5)
            result = await run_level(url, model, workload, args.concurrency, None, {}, 600, 0)
            if task is not None:
                stop.set()
                await asyncio.wait_for(task, 30)
                events.append(counts["events"] / result["duration_s"])
            assert result["failed"] == 0, result["errors"]
            runs[mode].append(result["output_tokens_per_s"])
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    return {"model": model, "num_blocks": num_blocks, "output_tokens_per_s_without": runs["off"],
            "output_tokens_per_s_with": runs["on"], "dashboard_events_per_s": [round(e, 2) for e in events],
            "throughput_cost_percent": round(100 * (1 - on / off), 2),
            "snapshot_ms": round(snapshot_ms(num_blocks), 3)}


def snapshot_ms(num_blocks: int, block_size: int = 16) -> float:
    """Median ms of BlockManager.snapshot() over a pool with half its blocks held by sequences."""
    from minivllm.core.sequence import SequenceGroup
    from minivllm.sampling_params import SamplingParams
    manager = BlockManager(num_blocks, block_size)
    for i in range(num_blocks // 2 // 8):
        group = SequenceGroup(f"r{i}", None, list(range(i, i + 8 * block_size)), SamplingParams(max_tokens=1))
        manager.allocate_slots(group.seqs[0], 8 * block_size)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        manager.snapshot()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--server-args", default="")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default=None)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = out / "dashboard_cost_server.log"
    process = start_server(args, port, log_path)
    try:
        asyncio.run(wait_healthy(url, process, 900, log_path))
        result = asyncio.run(measure(args, url))
    finally:
        stop_server(process)
    device = device_name()
    record = {"benchmark": "dashboard_cost", "device": device, "commit": git_commit(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": run_command(),
              "config": {k: v for k, v in vars(args).items() if k != "out"}, **result}
    tag = args.tag or device_tag(device)
    path = out / f"dashboard_cost_{tag}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(result))
    print("wrote", path)


if __name__ == "__main__":
    main()
