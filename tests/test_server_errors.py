"""Every error class of the server over raw HTTP: status, OpenAI error object, and a correct answer
from the same server right after. The server requires an API key and admits at most 2 waiting
requests; the 429 case pauses the engine loop so the waiting queue fills deterministically.
"""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server.api_server import ServerThread, build_app

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 1024
MAX_WAITING = 2


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine.from_config(EngineConfig(kv_cache_memory=64 << 20, max_model_len=MAX_MODEL_LEN,
                                                  max_num_waiting=MAX_WAITING))
    thread = ServerThread(build_app(engine, served_model_name="smol", api_key=KEY))
    url = thread.start()
    http = httpx.Client(base_url=url, headers=AUTH, timeout=60)
    yield SimpleNamespace(url=url, engine=engine, http=http)
    http.close()
    thread.stop()


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_serves(server) -> None:
    """A correct request right after an error gets a correct answer."""
    response = server.http.post("/v1/completions", json={"model": "smol", "prompt": "Hello", "max_tokens": 1,
                                                         "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 1


def test_api_key_is_required_on_api_routes(server):
    body = {"model": "smol", "prompt": "Hello", "max_tokens": 1}
    error = assert_error(httpx.post(server.url + "/v1/completions", json=body), 401)
    assert error["code"] == "invalid_api_key"
    wrong = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert_error(wrong, 401)
    assert wrong.headers["WWW-Authenticate"] == "Bearer"
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in sdk.models.list().data] == ["smol"]
    assert_serves(server)


def test_unknown_model_is_404(server):
    error = assert_error(server.http.post("/v1/chat/completions", json={
        "model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}), 404, "model")
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).completions.create(
            model="gpt-4", prompt="hi", max_tokens=1)
    assert_error(server.http.get("/v1/nothing-here"), 404)
    assert_serves(server)


CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("chat: negative temperature", "/v1/chat/completions", {"messages": CHAT, "temperature": -1}, "temperature"),
    ("chat: n=0", "/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
    ("chat: no messages field", "/v1/chat/completions", {"max_tokens": 1}, "messages"),
    ("chat: empty messages", "/v1/chat/completions", {"messages": []}, "messages"),
    ("chat: unknown role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
     "messages.0.role"),
    ("chat: max_tokens not a number", "/v1/chat/completions", {"messages": CHAT, "max_tokens": "lots"}, "max_tokens"),
    ("chat: top_logprobs without logprobs", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2},
     "top_logprobs"),
    ("chat: top_logprobs too many", "/v1/chat/completions", {"messages": CHAT, "logprobs": True,
                                                             "top_logprobs": 50}, "top_logprobs"),
    ("chat: tools", "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("completion: top_p 0", "/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completion: max_tokens 0", "/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completion: empty prompt", "/v1/completions", {"prompt": ""}, "prompt"),
    ("completion: prompt token out of vocab", "/v1/completions", {"prompt": [1, 10**9]}, None),
    ("completion: logit_bias key", "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("completion: logit_bias token out of vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 1}},
     "logit_bias"),
    ("completion: stop_token_ids out of vocab", "/v1/completions", {"prompt": "x", "stop_token_ids": [-3]},
     "stop_token_ids"),
    ("completion: stop not a string", "/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("completion: priority under fcfs", "/v1/completions", {"prompt": "x", "priority": 3}, "priority"),
]


@pytest.mark.parametrize("path, body, param", [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_invalid_fields_are_400(server, path, body, param):
    error = assert_error(server.http.post(path, json={"model": "smol", **body}), 400, param)
    assert error["type"] == "invalid_request_error"
    assert_serves(server)


def test_malformed_json_is_400(server):
    response = server.http.post("/v1/completions", content=b'{"prompt": "x", ', headers={"Content-Type":
                                                                                          "application/json"})
    assert "JSON" in assert_error(response, 400)["message"]
    assert_serves(server)


def test_prompt_over_the_context_length_is_400_with_the_lengths(server):
    # Token-id prompts make the lengths exact.
    error = assert_error(server.http.post("/v1/completions", json={"prompt": [28] * 1100}), 400)
    assert "1024" in error["message"] and "1100" in error["message"]
    error = assert_error(server.http.post("/v1/completions", json={"prompt": [28] * 1000, "max_tokens": 100}),
                         400, "max_tokens")
    assert all(str(n) in error["message"] for n in (1024, 1100, 1000, 100))

    messages = [{"role": "user", "content": "hello " * 1200}]
    count = server.http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert count > MAX_MODEL_LEN
    error = assert_error(server.http.post("/v1/chat/completions", json={"messages": messages}), 400)
    assert "1024" in error["message"] and str(count) in error["message"]
    assert_serves(server)


def test_tokenize_detokenize_round_trip(server):
    tokens = server.http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert server.http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "Hello world"
    assert_error(server.http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_error(server.http.post("/tokenize", json={}), 400)


def waiting(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("minivllm:num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no num_requests_waiting in /metrics")


def test_full_waiting_queue_is_429_with_retry_after(server):
    body = {"model": "smol", "prompt": "Hello", "max_tokens": 2, "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            server.engine.pause()  # requests are admitted but not scheduled: they stay waiting
            try:
                queued = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(MAX_WAITING)]
                deadline = time.monotonic() + 30
                while waiting(server) < MAX_WAITING:
                    assert time.monotonic() < deadline, "requests never reached the waiting queue"
                    await asyncio.sleep(0.05)
                rejected = await http.post("/v1/completions", json=body)
                sdk = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    await sdk.completions.create(**body)
            finally:
                server.engine.resume()
            return rejected, await asyncio.gather(*queued)

    rejected, served = asyncio.run(scenario())
    error = assert_error(rejected, 429)
    assert error["code"] == "rate_limit_exceeded"
    assert int(rejected.headers["Retry-After"]) >= 1
    assert [r.status_code for r in served] == [200] * MAX_WAITING  # the queued ones were served after all
    assert waiting(server) == 0
    assert_serves(server)
