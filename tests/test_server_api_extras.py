"""The API fields vLLM users rely on beyond plain sampling, through the official `openai` SDK against one
live server on the default model: echo + logprobs (prompt logprobs) on /v1/completions; structured outputs
(response_format, guided_*) on chat and completions, streamed or not, checked with jsonschema; tool calls
(required, named, auto with the hermes parser) whole and streamed, and tool results on the next turn."""
from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import jsonschema
import openai
import pytest

from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.server.api_server import ServerThread, build_app

PROMPT = "Paris is the capital of France, and Berlin is the capital of"


@pytest.fixture(scope="module")
def llm():
    # Room for 40 concurrent short requests without preemption.
    return LLM(kv_cache_memory=384 << 20, max_model_len=1024)


@pytest.fixture(scope="module")
def offline(llm):
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, prompt_logprobs=1)
    return SimpleNamespace(echo=llm.generate([PROMPT], params, use_tqdm=False)[0])


@pytest.fixture(scope="module")
def client(llm, offline):
    thread = ServerThread(build_app(AsyncEngine(llm.llm_engine), tool_call_parser="hermes",
                                    enable_auto_tool_choice=True))
    url = thread.start()
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    thread.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_are_the_offline_prompt_logprobs(client, offline, stream):
    ref = offline.echo
    kwargs = dict(model="", prompt=PROMPT, max_tokens=2, temperature=0.0, echo=True, logprobs=1)
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        logprobs = SimpleNamespace(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for c in chunks:
            if c.choices and c.choices[0].logprobs:
                for field in vars(logprobs):
                    getattr(logprobs, field).extend(getattr(c.choices[0].logprobs, field))
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, logprobs = choice.text, choice.logprobs
    assert text == PROMPT + ref.outputs[0].text
    num_prompt = len(ref.prompt_token_ids)
    assert len(logprobs.tokens) == num_prompt + 2
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [ref.prompt_logprobs[p][t].logprob for p, t in enumerate(ref.prompt_token_ids) if p] + \
               [d[t].logprob for d, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(logprobs.token_logprobs[1:], expected))
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens[:num_prompt]) == PROMPT


SUBJECTS = ["a retired sailor", "a young chef in Lyon", "a cat owner", "a chess champion", "an astronaut",
            "a beekeeper", "a jazz pianist", "a marathon runner", "a librarian in Oslo", "a pirate captain",
            "a software engineer", "a farmer with goats", "a painter", "a detective", "a child who loves dinosaurs",
            "a mountain guide", "a violin maker", "a nurse", "a street musician", "a robot"]
# Strings bounded by patterns (xgrammar compiles a pattern to one automaton; `maxLength` unrolls into one
# rule per character and cost ~2 ms per mask here), so a repetitive small model still closes every string.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z .'-]{1,20}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "pattern": "^[a-z ]{1,12}$"}, "maxItems": 3},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "home": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                                                  "has_garden": {"type": "boolean"}},
                 "required": ["city", "has_garden"]},
    },
    "required": ["name", "age", "hobbies", "mood", "home"],
}


def chat_text(client, stream: bool, **kwargs) -> tuple[str, str]:
    """(content, finish_reason) of one chat completion, reassembled from the deltas when streaming."""
    if not stream:
        choice = client.chat.completions.create(model="", stream=False, **kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model="", stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def run_all(client, response_format: dict, max_tokens: int, template: str = "Describe {} as a JSON record.",
            **sampling) -> list[tuple[str, str]]:
    """Every prompt streamed and not, all at once (one shared batch keeps the CPU run short)."""
    jobs = [(template.format(subject), stream) for subject in SUBJECTS for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: chat_text(
            client, job[1], messages=[{"role": "user", "content": job[0]}], temperature=0.0,
            max_tokens=max_tokens, response_format=response_format, **sampling), jobs))


@pytest.mark.long
def test_json_schema_outputs_parse_and_validate(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    results = run_all(client, response_format, max_tokens=100)
    for text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert results[0::2] == results[1::2]  # streamed text equals the non-streamed one
    assert len({text for text, _ in results}) > 10


def test_json_mode_outputs_are_json_objects(client):
    # JSON mode bounds no string, and this small model, greedy, loops inside one on "a jazz pianist"
    # ('"family": {"Johnny Cage": "Johnny Cage, Johnny Cage, ...') until max_tokens cuts the object
    # open. A mild repetition penalty, as a user of a small model sets, ends every object.
    results = run_all(client, {"type": "json_object"}, max_tokens=80, template="Give a short JSON object with "
                      "the name and age of {}.", extra_body={"repetition_penalty": 1.1})
    for text, finish in results:
        assert finish == "stop", text
        assert isinstance(json.loads(text), dict), text
    assert results[0::2] == results[1::2]
    assert len({text for text, _ in results}) > 10


def test_guided_choice_and_regex_always_match(client):
    choices = ["positive", "negative", "neutral"]
    for stream in (False, True):
        texts = [chat_text(client, stream, messages=[{"role": "user", "content": f"Is '{s}' a happy phrase?"}],
                           temperature=1.0, max_tokens=8, extra_body={"guided_choice": choices})[0]
                 for s in SUBJECTS[:4]]
        assert all(t in choices for t in texts), texts
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    completion = client.completions.create(model="", prompt="Name and age of a sailor:", n=6, temperature=1.0,
                                           max_tokens=16, extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.text) for c in completion.choices), [c.text for c in completion.choices]
    completion = client.completions.create(model="", prompt="Answer:", max_tokens=16, temperature=1.0, n=4,
                                           extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert all(c.text in ("up", "down") for c in completion.choices)


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {"response_format": {"type": "yaml"}},
    {"guided_json": "{not json"},
    {"guided_regex": "a", "guided_choice": ["a"]},
    {"structured_outputs": {"xml": "<a/>"}},
    {"structured_outputs": {"regex": 5}},
    {"response_format": {"type": "json_schema", "json_schema": "person"}},
    {"guided_json": {"type": 5}},
    {"guided_choice": ["a", ""]},
])
def test_bad_structured_output_requests_are_400(client, body):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=body)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def streamed_tool_calls(client, **kwargs) -> tuple[list[dict], str | None]:
    """Reassemble OpenAI tool-call deltas: by index, id/name from the first delta, arguments concatenated."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="", stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_are_valid_and_stream_the_same(client, tool_choice):
    kwargs = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0.0, max_tokens=60)
    choice = client.chat.completions.create(model="", **kwargs).choices[0]
    calls = choice.message.tool_calls
    assert calls and choice.message.content is None
    for call in calls:
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert call.id.startswith("call_") and call.type == "function"
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    if tool_choice != "required":
        assert [c.function.name for c in calls] == ["get_weather"]
    streamed, finish = streamed_tool_calls(client, **kwargs)
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert all(c["id"].startswith("call_") for c in streamed) and finish == choice.finish_reason


def test_tool_results_are_accepted_on_the_next_turn(client):
    call = client.chat.completions.create(model="", messages=ASK, tools=[WEATHER], tool_choice="required",
                                          temperature=0.0, max_tokens=60).choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    reply = client.chat.completions.create(model="", messages=messages, tools=[WEATHER], tool_choice="none",
                                           temperature=0.0, max_tokens=12).choices[0]
    assert reply.message.content and not reply.message.tool_calls and reply.finish_reason in ("stop", "length")


def test_auto_tool_choice_parses_or_passes_content_through(client):
    """The hermes parser is on: whatever the model says comes back as content or as parsed calls, whole
    and streamed alike."""
    kwargs = dict(messages=ASK, tools=[WEATHER], temperature=0.0, max_tokens=24)
    message = client.chat.completions.create(model="", **kwargs).choices[0].message
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="", stream=True, **kwargs) if c.choices)
    if message.tool_calls:
        assert all(jsonschema.validate(json.loads(c.function.arguments), WEATHER["function"]["parameters"]) is None
                   for c in message.tool_calls)
    else:
        assert text == message.content


@pytest.mark.parametrize("body", [
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tool_choice": "required"},
    {"tools": [{"type": "function"}], "tool_choice": "required"},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}], "tool_choice": "required"},
    {"tools": [WEATHER], "tool_choice": "sometimes"},
    {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
])
def test_bad_tool_requests_are_400(client, body):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="", messages=ASK, max_tokens=4, extra_body=body)
