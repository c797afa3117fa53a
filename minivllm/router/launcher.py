"""`minivllm serve --data-parallel-size M`: M engine replicas behind one OpenAI endpoint.

Each replica is an ordinary `minivllm serve` process on an internal port of 127.0.0.1 (its own
engine, KV cache and, with tensor parallelism, its own TP group); on CUDA replica i sees GPUs
[i*TP, (i+1)*TP) of the visible ones through CUDA_VISIBLE_DEVICES. Once every replica answers
/health, the router opens the public port in front of them. Stopping the router stops the replicas.
`minivllm router --serve "ARGS" --serve "ARGS"` starts servers of different models the same way, so
several models are served behind one URL by one command (the router routes by the request's `model`).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from minivllm.router.app import run_router

logger = logging.getLogger(__name__)

_OWN_OPTIONS = {"--data-parallel-size": 1, "-dp": 1, "--host": 1, "--port": 1}   # option -> values it takes


def replica_argv(argv: list[str], port: int) -> list[str]:
    """The serve command line of one replica: the user's, minus DP, host and port, on an internal port."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN_OPTIONS:
            skip = 0 if "=" in arg else _OWN_OPTIONS[name]
            continue
        out.append(arg)
    return out + ["--host", "127.0.0.1", "--port", str(port)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpus() -> list[str]:
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(urls)
    while pending:
        for url, proc in zip(urls, procs):
            if proc.poll() is not None:
                raise RuntimeError(f"replica {url} exited with code {proc.returncode} while starting")
            if url in pending:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        pending.discard(url)
                except httpx.HTTPError:
                    pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas {sorted(pending)} not healthy after {timeout_s:.0f} s")
        time.sleep(0.5)


def start_replicas(argv: list[str], data_parallel_size: int, tensor_parallel_size: int = 1,
                   startup_timeout_s: float = 1800) -> tuple[list[str], list[subprocess.Popen]]:
    """Start `data_parallel_size` copies of the serve command line `argv` and wait until all are healthy;
    returns their URLs and processes."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
    return start_servers([(argv, tensor_parallel_size)] * data_parallel_size, startup_timeout_s)


def start_servers(specs: list[tuple[list[str], int]], startup_timeout_s: float = 1800
                  ) -> tuple[list[str], list[subprocess.Popen]]:
    """One server per (serve argv, GPUs it takes), on internal ports, GPUs handed out in order."""
    gpus = _visible_gpus()
    needed = sum(n for _, n in specs)
    if gpus and len(gpus) < needed:
        raise ValueError(f"the servers need {needed} GPUs, {len(gpus)} visible")
    ports = [_free_port() for _ in specs]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs, first_gpu = [], 0
    for (argv, num_gpus), p in zip(specs, ports):
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[first_gpu:first_gpu + num_gpus])
            first_gpu += num_gpus
        procs.append(subprocess.Popen([sys.executable, "-m", "minivllm.cli"] + replica_argv(argv, p), env=env))
    try:
        wait_healthy(urls, procs, startup_timeout_s)
    except BaseException:
        stop_replicas(procs)
        raise
    return urls, procs


def stop_replicas(procs: list[subprocess.Popen], timeout_s: float = 30) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)   # graceful: uvicorn drains, the engine shuts down
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_data_parallel(argv: list[str], data_parallel_size: int, tensor_parallel_size: int, host: str,
                        port: int, log_level: str = "info") -> None:
    urls, procs = start_replicas(argv, data_parallel_size, tensor_parallel_size)
    logger.info("%d replicas ready: %s", data_parallel_size, urls)
    try:
        run_router(urls, host, port, log_level=log_level)
    finally:
        stop_replicas(procs)


def route_and_serve(backends: list[str], serve: list[tuple[list[str], int]], host: str, port: int,
                    health_interval: float, api_key: str | None) -> None:
    """`minivllm router`: the given backends plus a server per (serve argv, GPUs it takes), behind one port."""
    urls, procs = start_servers(serve) if serve else ([], [])
    try:
        run_router(list(backends) + urls, host, port, health_interval, api_key)
    finally:
        stop_replicas(procs)
