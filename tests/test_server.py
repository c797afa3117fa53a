"""The OpenAI-compatible server, end to end: a real uvicorn server on a free port serving the default
model on CPU, driven by the official `openai` SDK (only base_url/api_key set).

Greedy answers are checked against the offline `LLM` API with the same settings; streaming against
non-streaming; seeded sampling against itself; /metrics against the requests just made; and 20
clients that hang up mid-stream must leave no KV blocks behind.
"""
from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.server.api_server import ServerThread, build_app

# A small KV cache and context keep the CPU run fast; the offline reference uses the same settings.
SETTINGS = dict(kv_cache_memory=64 << 20, max_model_len=1024)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
MAX_TOKENS = 8
TOP = 2


@pytest.fixture(scope="module")
def llm():
    return LLM(**SETTINGS)


@pytest.fixture(scope="module")
def offline(llm):
    """Greedy reference outputs from the offline API, computed before the server starts."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    chat = llm.chat(CHAT, params, use_tqdm=False)[0]
    completion = llm.generate([PROMPT], params, use_tqdm=False)[0]
    return SimpleNamespace(chat=chat, completion=completion)


@pytest.fixture(scope="module")
def server(llm, offline):
    # The server takes over the offline API's engine once the references exist: same weights and
    # settings, and one model load less on a CPU shared with other work.
    engine = AsyncEngine(llm.llm_engine)
    thread = ServerThread(build_app(engine))
    url = thread.start()
    yield SimpleNamespace(url=url, engine=engine)
    thread.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels without model_name): value}."""
    text = httpx.get(url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def stop_inside(text: str) -> tuple[str, str]:
    """A two-character stop string whose first occurrence is mid-text, and the text before it."""
    for start in range(len(text) // 2, 0, -1):
        stop = text[start:start + 2]
        if len(stop) == 2 and text.index(stop) == start:
            return stop, text[:start]
    raise AssertionError(f"no usable stop string in {text!r}")


def test_health_version_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == [server.engine.model_name]


def test_chat_greedy_matches_offline(client, offline):
    expected = offline.chat.outputs[0]
    response = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT,
                                              temperature=0, max_tokens=MAX_TOKENS, logprobs=True,
                                              top_logprobs=TOP)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(offline.chat.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + len(expected.token_ids)
    content = choice.logprobs.content
    assert len(content) == len(expected.token_ids)
    for entry, token_id, ref in zip(content, expected.token_ids, expected.logprobs):
        assert entry.logprob == pytest.approx(ref[token_id].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == TOP
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert bytes(entry.bytes).decode() == entry.token
    # The tokens spell the text (plus the end-of-sequence token, when that ended it).
    assert "".join(e.token for e in content).startswith(expected.text)


def test_chat_stream_matches_offline_and_ends_with_usage(client, offline):
    expected = offline.chat.outputs[0]
    chunks = list(client.chat.completions.create(model="", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected.text
    assert [c.choices[0].finish_reason for c in content][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expected.token_ids)
    assert usage_chunk.usage.prompt_tokens == len(offline.chat.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_matches_offline_streamed_or_not(client, offline):
    expected = offline.completion.outputs[0]
    response = client.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP)
    choice = response.choices[0]
    assert response.object == "text_completion"
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(offline.completion.prompt_token_ids)
    assert response.usage.completion_tokens == MAX_TOKENS
    lp = choice.logprobs
    assert "".join(lp.tokens).startswith(expected.text)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(MAX_TOKENS)]
    for value, top, token_id, ref in zip(lp.token_logprobs, lp.top_logprobs, expected.token_ids, expected.logprobs):
        assert value == pytest.approx(ref[token_id].logprob, abs=1e-4)
        assert max(top.values()) == pytest.approx(value, abs=1e-6)  # greedy: the chosen one is the top one

    chunks = list(client.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_stop_strings_cut_the_greedy_text(client, offline):
    stop, before = stop_inside(offline.completion.outputs[0].text)
    response = client.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, stop=[stop])
    assert response.choices[0].text == before and response.choices[0].finish_reason == "stop"

    stop, before = stop_inside(offline.chat.outputs[0].text)
    chunks = list(client.chat.completions.create(model="", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS,
                                                 stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == before
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n2_and_seed_reproducibility(client):
    kwargs = dict(model="", prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=1.0, n=2, seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens <= 2 * MAX_TOKENS
    assert all(c.finish_reason in ("stop", "length") for c in first.choices)

    # Chat, n=2, seeded: the streamed deltas of each choice add up to the non-streamed answer.
    chat_kwargs = dict(model="", messages=CHAT, max_tokens=MAX_TOKENS, temperature=1.0, n=2, seed=99)
    whole = client.chat.completions.create(**chat_kwargs)
    texts, roles = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(**chat_kwargs, stream=True):
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)
            texts[choice.index] += choice.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_metrics_parse_and_counters_move(server, client):
    before = metrics(server.url)
    client.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS)
    after = metrics(server.url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("minivllm:request_success_total", finished_reason="length") == 1
    assert delta("minivllm:generation_tokens_total") == MAX_TOKENS
    assert delta("minivllm:prompt_tokens_total") + delta("minivllm:prefix_cache_hits_total") >= 5
    assert delta("minivllm:prefix_cache_queries_total") > 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"minivllm:{histogram}_count") == 1
    assert delta("minivllm:inter_token_latency_seconds_count") >= 1
    # Every step's tokens: the prompt's computed part, then one decode for each token after the first.
    assert delta("minivllm:iteration_tokens_total_sum") == delta("minivllm:prompt_tokens_total") + MAX_TOKENS - 1
    assert delta("minivllm:iteration_tokens_total_count") == MAX_TOKENS
    assert 0.0 <= after[("minivllm:kv_cache_usage_perc", ())] <= 1.0
    assert after[("minivllm:num_requests_running", ())] == 0


NUM_GIVE_UP = 3


def test_clients_that_hang_up_free_their_blocks(server, client):
    before = metrics(server.url)

    async def hang_up(i: int) -> None:
        body = {"model": "", "prompt": f"Story number {i}:", "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = 0
                async for line in response.aiter_lines():
                    events += line.startswith("data: ")
                    if events == 2:
                        return  # hang up mid-stream: the context managers close the connection

    async def give_up(i: int) -> None:
        """A non-streaming client that stops waiting: its request is aborted at the next output."""
        body = {"model": "", "prompt": f"Essay number {i}:", "max_tokens": 500, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(60, read=1.0)) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json=body)

    async def all_hang_up():
        await asyncio.gather(*(hang_up(i) for i in range(20)), *(give_up(i) for i in range(NUM_GIVE_UP)))

    asyncio.run(all_hang_up())
    deadline = time.monotonic() + 30
    while True:
        now = metrics(server.url)
        idle = (now[("minivllm:kv_cache_usage_perc", ())] == 0.0 and now[("minivllm:num_requests_running", ())] == 0
                and now[("minivllm:num_requests_waiting", ())] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, f"blocks still held after the clients left: {now}"
    aborted = (now[("minivllm:request_success_total", (("finished_reason", "abort"),))]
               - before.get(("minivllm:request_success_total", (("finished_reason", "abort"),)), 0.0))
    assert aborted == 20 + NUM_GIVE_UP
    generated = now[("minivllm:generation_tokens_total", ())] - before[("minivllm:generation_tokens_total", ())]
    assert generated < (20 + NUM_GIVE_UP) * 500 / 2  # stopped long before their 500 tokens
    assert server.engine.num_streams == 0

    response = client.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=2)
    assert response.choices[0].text and response.usage.completion_tokens == 2
    assert math.isclose(metrics(server.url)[("minivllm:kv_cache_usage_perc", ())], 0.0)
