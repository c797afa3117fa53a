"""Graceful shutdown of a real `minivllm serve` process: SIGTERM while a stream is running makes new
requests get 503 (an OpenAI error) and /health 503, lets the running stream finish whole, and the
process exits 0.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

MAX_TOKENS = 48


def start_server(*flags: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "minivllm.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--max-model-len",
         "256", "--kv-cache-memory", "32MiB", *flags], stderr=subprocess.PIPE, text=True, env=env)
    url = None
    for line in process.stderr:  # the address is logged once the port is bound
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if match:
            url = match.group(1)
            break
    assert url is not None, "the server did not start"
    threading.Thread(target=process.stderr.read, daemon=True).start()  # keep draining its log
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("the server never became healthy")


def test_sigterm_drains_running_requests_and_exits_zero():
    process, url = start_server("--shutdown-timeout", "60")
    try:
        first_chunk = threading.Event()
        result = {}

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                    "temperature": 0}
            text, finish = [], None
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
                    first_chunk.set()
            result.update(text="".join(text), finish=finish, status=response.status_code)

        client = threading.Thread(target=stream)
        client.start()
        assert first_chunk.wait(120)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(url + "/health").status_code == 503
        client.join(120)
        assert result["status"] == 200 and result["finish"] == "length"
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
