"""Soak test: many concurrent streaming clients against one `minivllm serve` on loopback, for a bounded
time and request count, with a KV pool small enough that preemption never stops.

Each client loops: a random chat or completion request with random max_tokens, n, stop strings and
logprobs, streamed; 20% of them hang up after a few chunks. Alongside, a greedy probe re-sends fixed
prompts whose outputs were recorded on the unloaded server before the load began. At the end:

    served requests, HTTP status counts (5xx must be 0), server crashes (the process must still be
    alive and healthy), KV blocks still in use once idle (leaks, from /dashboard/snapshot: must be 0),
    server RSS growth, preemptions, and how many greedy probes matched the unloaded outputs.

    # CPU, default model, 10 minutes
    python bench/soak.py --clients 32 --duration-s 600 --kv-cache-memory 24MiB --out bench/results --tag cpu
    # GPU, dummy Llama-3-8B, 256 clients, 5 minutes, a pool of 2048 blocks
    python bench/soak.py --model llama-3-8b --load-format dummy --clients 256 --duration-s 300 \\
        --server-args "--num-gpu-blocks-override 2048" --out $OUT --tag h100

Loopback only: the server is started here on 127.0.0.1 and killed at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout
from bench.common import git_commit, run_command  # noqa: E402
from bench.serve import device_name, free_port, start_server, stop_server, wait_healthy  # noqa: E402

PROBES = ["The capital of France is", "Water boils at", "The three primary colors are",
          "def fibonacci(n):", "Once upon a time, in a small village,"]
WORDS = ["the", "and", "time", "water", "city", "river", "light", "story", "number", "music"]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def random_request(rng: random.Random, max_tokens: int, use_token_ids: bool) -> tuple[str, dict]:
    """(path, body) of one random streaming request."""
    tokens = rng.randint(1, max_tokens)
    n = rng.choice([1, 1, 1, 1, 2, 3])
    body: dict = {"max_tokens": tokens, "n": n, "stream": True, "temperature": rng.choice([0.0, 0.7, 1.0]),
                  "seed": rng.randint(0, 1000)}
    if rng.random() < 0.3 and not use_token_ids:  # stop strings need a tokenizer
        body["stop"] = rng.sample(WORDS, rng.randint(1, 3))
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    if rng.random() < 0.5 and not use_token_ids:
        if rng.random() < 0.4:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    if rng.random() < 0.4:
        body["logprobs"] = rng.randint(0, 5)
    body["prompt"] = [rng.randint(100, 30000) for _ in range(rng.randint(4, 60))] if use_token_ids else text
    return "/v1/completions", body


class Soak:
    def __init__(self, args, url: str) -> None:
        self.args, self.url = args, url
        self.statuses: Counter = Counter()
        self.outcomes: Counter = Counter()  # finished / disconnected / stream_error / transport_error
        self.probe_results: Counter = Counter()
        self.mismatches: list[dict] = []
        self.num_started = 0
        self.deadline = 0.0

    def more(self) -> bool:
        return time.monotonic() < self.deadline and self.num_started < self.args.max_requests

    async def client(self, http: aiohttp.ClientSession, k: int) -> None:
        rng = random.Random(self.args.seed * 100003 + k)
        while self.more():
            self.num_started += 1
            path, body = random_request(rng, self.args.max_tokens, self.args.token_id_prompts)
            hang_up_after = rng.randint(1, 4) if rng.random() < self.args.disconnect_fraction else None
            try:
                async with http.post(self.url + path, json=body) as response:
                    self.statuses[response.status] += 1
                    if response.status != 200:
                        await response.read()
                        self.outcomes["http_error"] += 1
                        continue
                    chunks = 0
                    async for line in response.content:
                        if line.startswith(b"data: {") and b'"error"' in line[:20]:
                            self.outcomes["stream_error"] += 1
                        chunks += 1
                        if hang_up_after is not None and chunks >= hang_up_after:
                            break
                    self.outcomes["disconnected" if hang_up_after and chunks >= hang_up_after else "finished"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.outcomes["transport_error"] += 1
                self.outcomes[f"transport_error:{type(e).__name__}"] += 1

    def probe_prompt(self, i: int) -> str | list[int]:
        if self.args.token_id_prompts:
            return [1000 + 37 * i + 11 * j for j in range(8 + 4 * i)]
        return PROBES[i]

    async def greedy(self, http: aiohttp.ClientSession, i: int) -> str:
        body = {"prompt": self.probe_prompt(i), "max_tokens": self.args.probe_tokens, "temperature": 0.0}
        async with http.post(self.url + "/v1/completions", json=body) as response:
            self.statuses[response.status] += 1
            return (await response.json())["choices"][0]["text"]

    async def prober(self, http: aiohttp.ClientSession, reference: list[str]) -> None:
        i = 0
        while self.more():
            prompt = i % len(PROBES)
            i += 1
            try:
                text = await self.greedy(http, prompt)
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError):
                self.probe_results["error"] += 1
                continue
            same = text == reference[prompt]
            self.probe_results["identical" if same else "different"] += 1
            if not same and len(self.mismatches) < 5:
                self.mismatches.append({"prompt": self.probe_prompt(prompt), "unloaded": reference[prompt],
                                        "loaded": text})
            await asyncio.sleep(1.0)


async def get_json(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url) as response:
        return await response.json()


async def wait_idle(http: aiohttp.ClientSession, url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snapshot = (await get_json(http, url + "/dashboard/snapshot"))["snapshot"]
        scheduler = snapshot["scheduler"]
        idle = scheduler["num_running"] + scheduler["num_waiting"] + scheduler["num_preempted"] == 0
        if idle or time.monotonic() > deadline:
            return snapshot
        await asyncio.sleep(0.5)


async def soak(args, url: str, pid: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.clients + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        run = Soak(args, url)
        reference = [await run.greedy(http, i) for i in range(len(PROBES))]  # unloaded
        rss_start = rss_bytes(pid)
        started = time.monotonic()
        run.deadline = started + args.duration_s
        await asyncio.gather(run.prober(http, reference), *(run.client(http, k) for k in range(args.clients)))
        elapsed = time.monotonic() - started
        snapshot = await wait_idle(http, url)
        rss_end = rss_bytes(pid)
        healthy = (await http.get(url + "/health")).status == 200
        after = await run.greedy(http, 0)  # one more answer, unloaded again
        kv = snapshot["kv"]
    served = run.outcomes["finished"] + run.outcomes["disconnected"]
    return {
        "duration_s": round(elapsed, 1), "requests_started": run.num_started, "requests_served": served,
        "requests_finished": run.outcomes["finished"], "requests_disconnected": run.outcomes["disconnected"],
        "http_status_counts": {str(k): v for k, v in sorted(run.statuses.items())},
        "http_5xx": sum(v for k, v in run.statuses.items() if k >= 500),
        "stream_errors": run.outcomes["stream_error"],
        "transport_errors": run.outcomes["transport_error"],
        "outcomes": dict(run.outcomes), "server_healthy_after": healthy,
        "kv_blocks_total": kv["num_blocks"], "kv_blocks_leaked": kv["num_blocks"] - kv["num_free"],
        "num_preemptions": snapshot["scheduler"]["num_preemptions"],
        "rss_start_mb": round(rss_start / 2**20, 1), "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_growth_mb": round((rss_end - rss_start) / 2**20, 1),
        "greedy_probes": dict(run.probe_results), "greedy_mismatch_examples": run.mismatches,
        "greedy_after_load_identical": after == reference[0],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model for `minivllm serve` (default: the default model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--kv-cache-memory", default=None, help="e.g. 24MiB: a small pool keeps preemption constant")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--server-args", default="", help="more `minivllm serve` flags")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--duration-s", type=float, default=600)
    p.add_argument("--max-requests", type=int, default=1_000_000, help="stop after starting this many")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens is drawn from 1..this")
    p.add_argument("--probe-tokens", type=int, default=24)
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--token-id-prompts", action="store_true", help="completions with token ids only (dummy weights)")
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out", default="bench/results")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_args = f"--max-model-len {args.max_model_len} --max-num-seqs {min(args.clients, 256)} " + args.server_args
    if args.kv_cache_memory:
        server_args += f" --kv-cache-memory {args.kv_cache_memory}"
    args.server_args = server_args
    log_path = out / f"soak_{args.tag}_server.log"
    process = start_server(args, port, log_path)
    try:
        asyncio.run(wait_healthy(url, process, 900, log_path))
        result = asyncio.run(soak(args, url, process.pid))
        result["server_crashed"] = process.poll() is not None
    finally:
        stop_server(process)
    result["server_exit_code"] = process.returncode
    record = {"benchmark": "soak", "device": device_name(), "commit": git_commit(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": run_command(),
              "config": {k: v for k, v in vars(args).items() if k != "out"}, "cpu_count": os.cpu_count(),
              "server_command_args": shlex.split(server_args), **result}
    path = out / f"soak_{args.tag}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("requests_served", "http_5xx", "server_crashed", "kv_blocks_leaked",
                                             "rss_growth_mb", "num_preemptions", "greedy_probes")}))
    print("wrote", path)
    ok = (result["http_5xx"] == 0 and not result["server_crashed"] and result["kv_blocks_leaked"] == 0
          and result["server_healthy_after"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
