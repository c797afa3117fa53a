"""Server limits over raw HTTP against a live server with the default model on CPU: body size, JSON
depth, header count and size, caps on max_tokens and n, the queued-token budget (429 + Retry-After),
the per-request timeout, the API key on every path but the exempt ones, and error messages that carry
no traceback or path. After each abuse the same server must still answer a correct request.
"""
from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace

import httpx
import pytest

from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server.api_server import ServerThread, build_app
from minivllm.server.errors import scrub
from minivllm.server.limits import ServerLimits, json_depth
from tests.test_server_errors import assert_error as assert_openai_error

KEY = "sk-limits"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ServerLimits(max_request_body_bytes=4096, max_json_depth=8, h11_max_header_count=24,
                      h11_max_incomplete_event_size=16384, max_tokens_limit=16, max_n=2, max_queued_tokens=40)


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine.from_config(EngineConfig(kv_cache_memory=32 << 20, max_model_len=256))
    thread = ServerThread(build_app(engine, api_key=KEY, limits=LIMITS), limits=LIMITS)
    url = thread.start()
    http = httpx.Client(base_url=url, headers=AUTH, timeout=60)
    yield SimpleNamespace(url=url, engine=engine, http=http, app=thread.server.config.app)
    http.close()
    thread.stop()


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """An OpenAI error object with this status, whose message quotes no traceback and no path."""
    error = assert_openai_error(response, status, param)
    assert "Traceback" not in error["message"] and "/" not in error["message"], error
    return error


def assert_serves(server) -> None:
    response = server.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_json_depth_ignores_brackets_in_strings():
    for value, depth in (({"a": "[[[{{", "b": [[1]]}, 3), ({"a": "\\", "b": [[[2]]]}, 4),
                         (["\\\"[", {"k": "]]]"}], 2), ("x", 0), ([[[[[]]]]], 5)):
        assert json_depth(json.dumps(value).encode()) == depth


def test_scrub_removes_paths_and_tracebacks():
    message = 'cannot load /home/u/.cache/minivllm/model.gguf\nTraceback (most recent call last):\n  File "/x/y.py"'
    assert scrub(message) == "cannot load <path>"
    assert scrub("top_p must be in (0, 1], got 2") == "top_p must be in (0, 1], got 2"


def test_api_key_on_every_route_but_exempt_ones(server):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                         ("GET", "/version"), ("GET", "/openapi.json"), ("GET", "/dashboard"),
                         ("GET", "/no/such/route")):
        error = assert_error(httpx.request(method, server.url + path, json={}), 401)
        assert error["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert server.http.get("/version").status_code == 200
    assert_error(server.http.get("/no/such/route"), 404)  # with the key: the real answer


def test_body_size(server):
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    error = assert_error(server.http.post("/v1/completions", json=big), 413)
    assert error["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b" " * 1000
    assert_error(server.http.post("/v1/completions", content=chunks(),
                                  headers={**AUTH, "Content-Type": "application/json"}), 413)
    assert_serves(server)


def test_json_depth(server):
    deep = '{"prompt": "hi", "max_tokens": 1, "user": ' + "[" * 9 + "]" * 9 + "}"
    error = assert_error(server.http.post("/v1/completions", content=deep,
                                          headers={**AUTH, "Content-Type": "application/json"}), 400)
    assert "nested deeper" in error["message"]
    shallow = '{"prompt": "hi", "max_tokens": 1, "stop": ["[[[[[[[[[[[[[["]}'  # brackets in a string
    assert server.http.post("/v1/completions", content=shallow,
                            headers={**AUTH, "Content-Type": "application/json"}).status_code == 200


def test_headers(server):
    many = {**AUTH, **{f"x-h{i}": "1" for i in range(30)}}
    assert_error(httpx.get(server.url + "/v1/models", headers=many), 431)
    assert_error(httpx.get(server.url + "/v1/models", headers={**AUTH, "x-big": "a" * 20000}), 431)
    assert_serves(server)


def test_caps_on_max_tokens_and_n(server):
    assert_error(server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 17}), 400, "max_tokens")
    assert_error(server.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                "n": 3, "max_tokens": 1}), 400, "n")
    # No max_tokens: the cap is the default, so generation stops there.
    body = server.http.post("/v1/completions", json={"prompt": "Once upon a time", "temperature": 0,
                                                     "ignore_eos": True}).json()
    assert body.get("usage", {}).get("completion_tokens") == 16, body


def test_queued_tokens_429_and_release(server):
    async def scenario():
        server.engine.pause()  # nothing finishes: reservations pile up deterministically
        try:
            async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
                # "Hello" is 1 token; each request reserves 1 + 4 * 2 = 9 tokens; 4 fit in 40.
                body = {"prompt": "Hello", "max_tokens": 4, "n": 2, "temperature": 0}
                tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(4)]
                await asyncio.sleep(0.5)
                rejected = await client.post("/v1/completions", json=body)
                assert_error(rejected, 429)
                assert rejected.headers["Retry-After"] == "1"
                assert_error(await client.post("/v1/completions", json=body | {"prompt": "x " * 40}), 400)
                server.engine.resume()
                done = await asyncio.gather(*tasks)
                assert all(r.status_code == 200 for r in done), [r.text for r in done]
        finally:
            server.engine.resume()

    asyncio.run(scenario())
    assert server.app.state.queued_tokens.total == 0
    assert_serves(server)


def test_request_timeout(server):
    # Set only here (it is read per request): elsewhere a loaded CPU must not turn answers into 408s.
    LIMITS.request_timeout = 1.0
    server.engine.pause()
    try:
        error = assert_error(server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}), 408)
        assert error["code"] == "request_timeout"
        with server.http.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 4,
                                                                  "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert events[-1]["error"]["code"] == "request_timeout"
    finally:
        LIMITS.request_timeout = None
        server.engine.resume()
    assert server.app.state.queued_tokens.total == 0
    assert_serves(server)


def test_malformed_requests_get_openai_errors(server):
    sock = socket.create_connection(server.url.removeprefix("http://").split(":"))
    sock.sendall(b"GARBAGE / HTTP/1.1\r\n\r\n")  # not HTTP: the connection is refused politely
    sock.settimeout(10)
    assert sock.recv(100).startswith(b"HTTP/1.1 4")
    sock.close()
    for content in (b"{", b"\xff\xfe", b"[]", b'{"prompt": 5}', b'{"prompt": "a", "max_tokens": -1}'):
        assert_error(server.http.post("/v1/completions", content=content,
                                      headers={**AUTH, "Content-Type": "application/json"}), 400)
    assert_error(server.http.post("/v1/completions", json={"model": "/etc/passwd", "prompt": "a"}), 404)
    assert_serves(server)
