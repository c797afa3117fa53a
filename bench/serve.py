"""Serving benchmark: load a minivllm (or any OpenAI-compatible) server and report latency vs load.

One command starts `minivllm serve` as a subprocess, waits for /health, sweeps fixed concurrency
levels (or Poisson request rates), stops the server and writes JSON + CSV + a PNG:

    # GPU: dummy Llama-3-8B, 512-token prompts, 256 output tokens
    python bench/serve.py --model llama-3-8b --load-format dummy \\
        --concurrency 1,4,16,64 --input-len 512 --output-len 256 --out bench/results
    # CPU: the default model, small shapes
    python bench/serve.py --concurrency 1,4 --num-prompts 8 --input-len 64 --output-len 16
    # an already running server; Poisson arrivals at 2 and 8 requests/s
    python bench/serve.py --url http://localhost:8000 --request-rate 2,8
    # goodput: a rate sweep against a server with an ITL target and a baseline server without one
    python bench/serve.py --model llama-3-8b --load-format dummy --request-rate 2,4,8,12,16,20,24 \
        --num-prompts 200 --server-args '--max-itl-ms 20' --baseline-server-args '' --merge

Requests go to /v1/completions with token-id prompts (exact input lengths, no tokenizer needed here),
`ignore_eos` (exact output lengths) and `stream_options.continuous_usage_stats` (tokens per chunk).
TTFT: request sent -> first token chunk. ITL: gaps between token chunks (vLLM's definition).
TPOT: (e2e - TTFT) / (output tokens - 1). E2E: request sent -> last byte.

A rate sweep also reports each rate's SLO attainment (the share of requests with TTFT and their own ITL p95
within `--slo-ttft-ms` / `--slo-itl-p95-ms`), the goodput (bench/goodput.py) and the acceptance keys
(`rate8_itl_p95_ms`, ...) at the top level; `--baseline-server-args` or `--baseline-url` runs the same sweep
against a second server first and stores it under `baseline`, with the goodput ratio.

Each level also records what the engine's steps were, from the server's step histograms in /metrics (scraped
before and after the level): steps, tokens per step and, when the server times its steps (`--max-itl-ms` or
`--collect-step-times`), each step's mean time on the device and the device's mean idle time after it.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout
from bench.common import git_commit, run_command  # noqa: E402
from bench.goodput import PERCENTILES, SLO, attainment, goodput, plot_rates, rate_keys  # noqa: E402

TOKEN_ID_RANGE = (1000, 20000)  # inside every supported vocabulary; random ids avoid prefix-cache hits


# ---- workload ----------------------------------------------------------------------------------

def sample_lengths(dataset: str, num: int, input_len: int, output_len: int, range_ratio: float,
                   rng: np.random.Generator) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per request.

    random: uniform in [len * (1 - range_ratio), len * (1 + range_ratio)].
    sharegpt: heavy-tailed log-normal lengths shaped like ShareGPT conversations (median below the
    mean, a long tail), scaled so the means are input_len and output_len, clipped to 4x the mean.
    """
    if dataset == "random":
        def uniform(mean: int) -> np.ndarray:
            low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
            return rng.integers(low, high + 1, size=num)
        inputs, outputs = uniform(input_len), uniform(output_len)
    elif dataset == "sharegpt":
        def lognormal(mean: int, sigma: float) -> np.ndarray:
            mu = math.log(mean) - sigma ** 2 / 2  # E[X] = exp(mu + sigma^2 / 2) = mean
            return np.clip(rng.lognormal(mu, sigma, size=num).round(), 4, 4 * mean).astype(int)
        inputs, outputs = lognormal(input_len, 1.0), lognormal(output_len, 0.8)
    else:
        raise ValueError(f"unknown dataset {dataset!r}")
    return [(int(i), int(o)) for i, o in zip(inputs, outputs)]


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


async def send_request(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                       output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    result = RequestResult(prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = None
    try:
        async with http.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                now = time.perf_counter()
                usage = chunk.get("usage") or {}
                tokens = usage.get("completion_tokens", result.output_tokens + bool(chunk.get("choices")))
                if chunk.get("choices") and tokens > result.output_tokens:
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                result.output_tokens = max(result.output_tokens, tokens)
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens received"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_level(url: str, model: str, workload: list[tuple[list[int], int]], concurrency: int | None,
                    request_rate: float | None, headers: dict, timeout: float, seed: int,
                    slo: SLO | None = None) -> dict:
    """Send `workload` with at most `concurrency` in flight, or with Poisson arrivals at `request_rate`."""
    limit = asyncio.Semaphore(concurrency or len(workload))
    http_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=http_timeout, headers=headers,
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one(prompt, output_len):
            async with limit:
                return await send_request(http, url, model, prompt, output_len)

        rng = random.Random(seed)
        start = time.perf_counter()
        tasks = []
        for prompt, output_len in workload:
            tasks.append(asyncio.create_task(one(prompt, output_len)))
            if request_rate is not None and math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    if slo is not None:
        summary["slo_attainment"] = round(attainment(slo, results), 4)
    return summary


STEP_SERIES = ("minivllm:iteration_tokens_total", "minivllm:step_device_seconds", "minivllm:step_device_idle_seconds")


async def step_totals(url: str, headers: dict) -> dict[str, float] | None:
    """The `_count` and `_sum` of the server's step histograms (None when it exports none: not minivllm)."""
    try:
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url + "/metrics") as response:
                text = await response.text() if response.status == 200 else ""
    except aiohttp.ClientError:
        return None
    totals = {s.name: s.value for family in text_string_to_metric_families(text) if family.name in STEP_SERIES
              for s in family.samples if s.name.endswith(("_count", "_sum"))}
    return totals or None


def engine_steps(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """A level's steps from the totals before and after it: how many, tokens per step, and for timed steps the
    mean time on the device and idle time after it (ms) and the idle share of their sum."""
    if not before or not after:
        return None
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    steps = delta.get("minivllm:iteration_tokens_total_count", 0.0)
    if not steps:
        return None
    tokens = delta["minivllm:iteration_tokens_total_sum"]
    result = {"steps": int(steps), "tokens": int(tokens), "tokens_per_step": round(tokens / steps, 1)}
    timed = delta.get("minivllm:step_device_seconds_count", 0.0)
    if timed:
        busy = delta["minivllm:step_device_seconds_sum"]
        idle = delta["minivllm:step_device_idle_seconds_sum"]
        result.update(timed_steps=int(timed), device_ms_per_step=round(1e3 * busy / timed, 3),
                      idle_ms_per_step=round(1e3 * idle / timed, 3), idle_share=round(idle / (busy + idle), 4))
    return result


def _percentiles(values: list[float], scale: float = 1e3) -> dict:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    array = np.asarray(values) * scale
    return {"mean": round(float(array.mean()), 3),
            **{f"p{p}": round(float(np.percentile(array, p)), 3) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors[:5], "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_tokens_per_s": round(output_tokens / duration, 2),
        "total_tokens_per_s": round((output_tokens + prompt_tokens) / duration, 2),
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "itl_ms": _percentiles([gap for r in ok for gap in r.itl]),
        "tpot_ms": _percentiles([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "e2e_ms": _percentiles([r.e2e for r in ok]),
    }


# ---- the server --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, port: int, log_path: Path, server_args: str | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """`minivllm serve` on 127.0.0.1:`port` from this checkout (`env`: extra variables), logging to `log_path`."""
    command = [sys.executable, "-m", "minivllm.cli", "serve"] + ([args.model] if args.model else [])
    command += ["--host", "127.0.0.1", "--port", str(port), "--load-format", args.load_format,
                "--uvicorn-log-level", "warning"]
    command += shlex.split(args.server_args if server_args is None else server_args)
    print("starting:", shlex.join(command), f"(log: {log_path})", flush=True)
    log = open(log_path, "w")
    env = dict(os.environ, **(env or {}),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                            start_new_session=True)


async def wait_healthy(url: str, process: subprocess.Popen | None, timeout: float, log_path: Path | None) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            if process is not None and process.poll() is not None:
                tail = log_path.read_text()[-3000:] if log_path else ""
                raise RuntimeError(f"the server exited with code {process.returncode}:\n{tail}")
            try:
                async with http.get(url + "/health") as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server at {url} was not healthy within {timeout:.0f} s")
            await asyncio.sleep(1.0)


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully, then the engine
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---- reporting ---------------------------------------------------------------------------------

def device_name() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=10).stdout.strip().splitlines()
        if names:
            return f"{len(names)}x {names[0]}" if len(names) > 1 else names[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return "CPU"


def device_tag(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; any CPU -> 'cpu'."""
    if device.startswith("CPU"):
        return "cpu"
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device)
    return match.group(1).lower() if match else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def write_csv(path: Path, sweep_key: str, levels: dict) -> None:
    metrics = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
    header = [sweep_key, "num_requests", "completed", "failed", "duration_s", "request_throughput",
              "output_tokens_per_s", "total_tokens_per_s"]
    header += [f"{m}_{stat}" for m in metrics for stat in ("mean", *(f"p{p}" for p in PERCENTILES))]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for level, r in levels.items():
            row = [level] + [r[k] for k in header[1:8]]
            row += [r[m][stat] for m in metrics for stat in ("mean", *(f"p{p}" for p in PERCENTILES))]
            writer.writerow(row)


def plot(path: Path, sweep_key: str, levels: dict, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return False
    xs = [float(k) for k in levels]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, metric, name in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT", "ITL", "end-to-end latency")):
        for p, style in zip(PERCENTILES, ("o-", "s--", "^:")):
            ax.plot(xs, [levels[k][metric][f"p{p}"] or float("nan") for k in levels], style, label=f"p{p}")
        ax.set_title(f"{name} (ms)")
        ax.set_yscale("log")
    axes[3].plot(xs, [levels[k]["output_tokens_per_s"] for k in levels], "o-")
    axes[3].set_title("output tokens/s")
    for ax in axes:
        ax.set_xlabel(sweep_key.replace("_", " "))
        if all(x > 0 for x in xs) and len(xs) > 1:
            ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- main --------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    p.add_argument("--model", default=None, help="model for `minivllm serve` (default: the default model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--server-args", default="", help="extra `minivllm serve` flags, e.g. '--max-num-seqs 128'")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels of requests in flight")
    p.add_argument("--request-rate", default=None,
                   help="comma-separated Poisson rates (requests/s, 'inf' = all at once); replaces --concurrency")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="requests per level (default: 4 x concurrency, at least 16; 64 for rates)")
    p.add_argument("--dataset", choices=["random", "sharegpt"], default="random")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.0, help="random dataset: +- fraction around the lengths")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and ignored) before the sweep")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results"), help="output folder")
    p.add_argument("--tag", default=None, help="file name tag (default: the GPU, e.g. h100, or cpu)")
    p.add_argument("--slo-ttft-ms", type=float, default=SLO.ttft_ms, help="SLO: time to first token")
    p.add_argument("--slo-itl-p95-ms", type=float, default=SLO.itl_p95_ms, help="SLO: a request's own ITL p95")
    p.add_argument("--slo-fraction", type=float, default=SLO.min_fraction,
                   help="goodput: the highest rate at which at least this share of requests meets the SLO")
    p.add_argument("--baseline-server-args", default=None,
                   help="rate sweeps: first sweep a server started with these flags instead of --server-args "
                        "(e.g. '' against --server-args '--max-itl-ms 20'), stored under 'baseline'")
    p.add_argument("--baseline-url", default=None, help="rate sweeps: the baseline is this running server")
    p.add_argument("--merge", action="store_true",
                   help="keep the keys of an existing serve_<tag>.json that this run does not write")
    return p.parse_args(argv)


async def benchmark(args, url: str) -> tuple[str, dict]:
    slo = SLO(args.slo_ttft_ms, args.slo_itl_p95_ms, args.slo_fraction)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.get(url + "/v1/models") as response:
            response.raise_for_status()
            model = (await response.json())["data"][0]["id"]
    rng = np.random.default_rng(args.seed)

    def workload(num: int) -> list[tuple[list[int], int]]:
        lengths = sample_lengths(args.dataset, num, args.input_len, args.output_len, args.range_ratio, rng)
        return [(rng.integers(*TOKEN_ID_RANGE, size=n_in).tolist(), n_out) for n_in, n_out in lengths]

    if args.warmup:
        warm = await run_level(url, model, [(p, min(o, 16)) for p, o in workload(args.warmup)], 1, None, headers,
                               args.timeout, args.seed)
        if warm["failed"]:
            raise RuntimeError(f"warm-up requests failed: {warm['errors']}")
    if args.request_rate:
        sweep_key, values = "request_rate", [float(v) for v in args.request_rate.split(",")]
    else:
        sweep_key, values = "concurrency", [int(v) for v in args.concurrency.split(",")]
    levels = {}
    for value in values:
        totals_before = await step_totals(url, headers)
        if sweep_key == "concurrency":
            num = args.num_prompts or max(16, 4 * value)
            result = await run_level(url, model, workload(num), value, None, headers, args.timeout, args.seed)
        else:
            num = args.num_prompts or 64
            result = await run_level(url, model, workload(num), None, value, headers, args.timeout, args.seed, slo)
        steps = engine_steps(totals_before, await step_totals(url, headers))
        if steps is not None:
            result["engine_steps"] = steps
        levels[str(value)] = result
        print(f"{sweep_key}={value}: {result['completed']}/{num} ok, "
              f"TTFT p50 {result['ttft_ms']['p50']} ms, ITL p95 {result['itl_ms']['p95']} ms, "
              f"E2E p50 {result['e2e_ms']['p50']} ms, {result['output_tokens_per_s']} output tok/s"
              + (f", SLO met by {100 * result['slo_attainment']:.1f}%" if "slo_attainment" in result else ""),
              flush=True)
    summary = {"model": model, "levels": levels}
    if sweep_key == "request_rate":
        summary["goodput_rps"] = goodput(levels, slo)
        summary.update(rate_keys(levels))
    return sweep_key, summary


def sweep_one_server(args, url: str | None, server_args: str | None, log_path: Path) -> tuple[str, dict]:
    """Start a server (unless `url` names one), wait for /health, sweep it, stop it."""
    process = None
    try:
        if url is None:
            port = free_port()
            process = start_server(args, port, log_path, server_args)
            url = f"http://127.0.0.1:{port}"
            asyncio.run(wait_healthy(url, process, args.server_timeout, log_path))
        else:
            url = url.rstrip("/")
            asyncio.run(wait_healthy(url, None, args.server_timeout, None))
        return asyncio.run(benchmark(args, url))
    finally:
        if process is not None:
            stop_server(process)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = device_name()
    tag = args.tag or device_tag(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "out")}
    print(f"device: {device}\nconfig: {json.dumps(config)}", flush=True)

    baseline = None
    if args.request_rate and (args.baseline_url or args.baseline_server_args is not None):
        _, baseline = sweep_one_server(args, args.baseline_url, args.baseline_server_args,
                                       out / f"serve_{tag}.baseline.server.log")
    sweep_key, result = sweep_one_server(args, args.url, None, out / f"serve_{tag}.server.log")

    json_path = out / f"serve_{tag}.json"
    report = json.loads(json_path.read_text()) if args.merge and json_path.exists() else {}
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report.update({"device": device, "commit": git_commit(), "date": date, "command": run_command(),
                   "model": result["model"], "config": config, sweep_key: result.pop("levels")})
    report.update({k: v for k, v in result.items() if k != "model"})   # goodput_rps, rate8_itl_p95_ms, ...
    if baseline is not None:
        baseline["server_args"] = args.baseline_url or args.baseline_server_args
        baseline[sweep_key] = baseline.pop("levels")
        report["baseline"] = baseline
        good, base_good = result.get("goodput_rps"), baseline.get("goodput_rps")
        report["goodput_ratio_over_baseline"] = round(good / base_good, 3) if good and base_good else None
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    levels = report[sweep_key]
    write_csv(out / f"serve_{tag}.csv", sweep_key, levels)
    title = f"{result['model']} on {device}: {args.dataset} {args.input_len} in / {args.output_len} out"
    if sweep_key == "request_rate":
        runs = ({"baseline": baseline[sweep_key]} if baseline is not None else {}) | {"this run": levels}
        wrote_png = plot_rates(out / f"serve_{tag}.png", runs, SLO(args.slo_ttft_ms, args.slo_itl_p95_ms,
                                                                    args.slo_fraction), title)
    else:
        wrote_png = plot(out / f"serve_{tag}.png", sweep_key, levels, title)
    print(f"wrote {json_path}, .csv{', .png' if wrote_png else ''}")


if __name__ == "__main__":
    main()
