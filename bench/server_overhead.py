"""The HTTP server's own cost per streamed token: CPU time of the server's event-loop thread per token it streams.

Under load the engine's host work and the server's share the GIL (docs/serving.md, "Where a step's time goes
under load"), so every microsecond the event loop spends per chunk is taken from the engine's steps. This
bench isolates the server: the real app (`build_app`, AsyncEngine, routes, SSE streaming) in front of a paced
engine that holds no model and emits one token per running request every `--step-ms` (its loop sleeps, as a
thread waiting on the device does). `bench/serve.py --url` drives it from its own process with `--concurrency`
streaming clients, twice: `--output-len` tokens a request and half as many. Reported: the event-loop thread's CPU
microseconds per streamed token (the difference between the rounds over the difference in tokens) and per
request (the rest), the engine loop's achieved step period against the paced one, and the clients' ITL.

    python bench/server_overhead.py --concurrency 150 --output-len 256 --step-ms 8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout
from bench.common import run_metadata, write_json  # noqa: E402
from minivllm.engine.async_engine import AsyncEngine  # noqa: E402
from minivllm.engine.llm_engine import EngineStats  # noqa: E402
from minivllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from minivllm.server.api_server import ServerThread, build_app  # noqa: E402


class PacedEngine:
    """One token per running request per step, a step every `step_s` (slept, the GIL released as while the
    device runs); cumulative outputs as LLMEngine returns them, two characters of text per token."""

    model_name = "paced"
    max_model_len = 4096
    vocab_size = 32000
    quantization = None
    tokenizer = None
    config = None

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.requests: dict[str, tuple[list[int], list[int], int]] = {}
        self.num_steps = self.num_tokens = 0
        self.busy_since: float | None = None
        self.busy_s = 0.0

    def add_request(self, request_id, prompt, params, *, arrival_time=None, priority=0, **_) -> None:
        self.requests[request_id] = (list(prompt), [], params.max_tokens)

    def abort_request(self, request_ids) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        now = time.perf_counter()
        self.busy_since = self.busy_since or now
        time.sleep(self.step_s)
        outputs = []
        for request_id, (prompt, tokens, max_tokens) in list(self.requests.items()):
            tokens.append(1000 + len(tokens) % 97)
            done = len(tokens) >= max_tokens
            outputs.append(RequestOutput(request_id, None, prompt, [CompletionOutput(
                0, "ab" * len(tokens), list(tokens), finish_reason="length" if done else None)], done))
            if done:
                del self.requests[request_id]
        self.num_steps += 1
        self.num_tokens += len(outputs)
        if not self.requests:
            self.busy_s += time.perf_counter() - self.busy_since
            self.busy_since = None
        return outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, 0.0, 0, 0, 0, 0, self.num_tokens)

    def snapshot(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


def thread_cpu_s(thread_ident: int) -> float:
    """CPU seconds (user + system) of one thread of this process so far."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread_ident))


def stream_once(url: str, concurrency: int, output_len: int, loop_tid: int) -> tuple[float, dict]:
    """One round of `concurrency` streaming requests from bench/serve.py in its own process: the event loop's
    CPU seconds over it, and the clients' level summary."""
    with tempfile.TemporaryDirectory() as client_out:
        cpu_before = thread_cpu_s(loop_tid)
        subprocess.run(
            [sys.executable, str(REPO / "bench" / "serve.py"), "--url", url, "--concurrency", str(concurrency),
             "--num-prompts", str(concurrency), "--input-len", "16", "--output-len", str(output_len),
             "--warmup", "0", "--out", client_out, "--tag", "client"], capture_output=True, text=True, check=True)
        cpu = thread_cpu_s(loop_tid) - cpu_before
        return cpu, json.loads((Path(client_out) / "serve_client.json").read_text())["concurrency"][str(concurrency)]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=150)
    p.add_argument("--output-len", type=int, default=256, help="tokens per request (a second round streams half)")
    p.add_argument("--step-ms", type=float, default=8.0, help="the paced engine's step period")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--tag", default="cpu")
    args = p.parse_args(argv)

    engine = PacedEngine(args.step_ms / 1e3)
    server = ServerThread(build_app(AsyncEngine(engine)))
    url = server.start()
    loop_tid = server.thread.ident   # uvicorn's thread: the event loop that streams
    rounds = {}
    try:
        for output_len in (args.output_len // 2, args.output_len):
            steps, tokens, busy = engine.num_steps, engine.num_tokens, engine.busy_s
            cpu, level = stream_once(url, args.concurrency, output_len, loop_tid)
            num_steps = engine.num_steps - steps
            rounds[output_len] = {"event_loop_cpu_s": round(cpu, 4), "tokens": engine.num_tokens - tokens,
                                  "steps": num_steps,
                                  "achieved_step_ms": round(1e3 * (engine.busy_s - busy) / num_steps, 3),
                                  "completed": level["completed"], "itl_ms": level["itl_ms"],
                                  "ttft_ms": level["ttft_ms"]}
    finally:
        server.stop()
    short, full = rounds[args.output_len // 2], rounds[args.output_len]
    # Both rounds carry the same requests: the difference is the streaming of the extra tokens alone.
    per_token = (full["event_loop_cpu_s"] - short["event_loop_cpu_s"]) / (full["tokens"] - short["tokens"])
    per_request = (full["event_loop_cpu_s"] - per_token * full["tokens"]) / args.concurrency
    report = {
        **run_metadata(torch.device("cpu")), "cpu_count": os.cpu_count(),
        "concurrency": args.concurrency, "output_len": args.output_len, "step_ms": args.step_ms,
        "event_loop_cpu_us_per_token": round(1e6 * per_token, 2),
        "event_loop_cpu_us_per_request": round(1e6 * per_request, 1),
        "event_loop_cpu_ms_per_step": round(1e3 * full["event_loop_cpu_s"] / full["steps"], 3),
        "rounds": {str(k): v for k, v in rounds.items()},
    }
    write_json(Path(args.out) / f"server_overhead_{args.tag}.json", report)
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict)}, indent=2))
    return report


if __name__ == "__main__":
    main()
