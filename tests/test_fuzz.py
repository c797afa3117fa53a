"""Property-based fuzzing of the live server from its own OpenAPI schema (schemathesis + hypothesis).

For every operation in /openapi.json, schema-valid (positive) and schema-violating (negative) requests
are generated and sent to a real server with the default model on CPU. Properties: no 5xx, ever; every
error is an OpenAI error object with no traceback in it; and the server answers a plain request after
the run. Generation stays cheap: a short context, and positive cases have max_tokens and n folded
into small values (the server's caps would reject larger ones with 400s anyway). The number of
generated cases is printed (and must reach a floor).
"""
from __future__ import annotations

import json

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server.api_server import ServerThread, build_app
from minivllm.server.limits import ServerLimits

# The fields the structured-output / tool-calling / prompt-logprobs work added. Hypothesis sets any one
# optional field in only a few of the generic cases (none, for some), so each also gets cases of its own.
NEW_FIELDS = {"/v1/chat/completions": ("response_format", "guided_json", "guided_regex", "guided_choice",
                                       "guided_grammar", "structured_outputs", "tools", "tool_choice"),
              "/v1/completions": ("response_format", "guided_json", "guided_regex", "guided_choice",
                                  "guided_grammar", "structured_outputs", "echo", "logprobs")}
EXAMPLES_PER_MODE = 30  # per operation; hypothesis stops earlier on small input spaces (GETs)
MIN_CASES = 200
LIMITS = ServerLimits(max_tokens_limit=4, max_n=2, max_request_body_bytes=1 << 20)


@pytest.fixture(scope="module")
def url():
    engine = AsyncEngine.from_config(EngineConfig(kv_cache_memory=16 << 20, max_model_len=128))
    with ServerThread(build_app(engine, limits=LIMITS), limits=LIMITS) as url:
        yield url


def keep_short(body) -> None:
    """Fold generation lengths of a positive case into small values, so the run stays fast."""
    if not isinstance(body, dict):
        return
    for name, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2), ("best_of", 2)):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = value % cap + 1


def check_response(status: int, content: bytes, content_type: str, where: str) -> None:
    assert status < 500, f"{where}: {status} {content[:500]!r}"
    assert b"Traceback" not in content, where
    if status >= 400:
        error = json.loads(content)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], f"{where}: {error}"
    elif content_type.startswith("text/event-stream"):
        for line in content.decode().splitlines():
            if line.startswith("data: {") and '"error"' in line:
                error = json.loads(line[6:])["error"]
                assert error.get("message") and error.get("type"), f"{where}: {error}"


@pytest.mark.long
def test_fuzz_openapi_schema(url, capsys):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/tokenize"}
    counts: dict[str, int] = {}
    with requests.Session() as session:
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                where = f"{operation.method.upper()} {operation.path} ({mode.value})"

                @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def run(case) -> None:
                    if mode is GenerationMode.POSITIVE:
                        keep_short(case.body)
                    response = case.call(base_url=url, session=session, timeout=120)
                    counts[where] = counts.get(where, 0) + 1
                    check_response(response.status_code, response.content,
                                   (response.headers.get("content-type") or [""])[0], where)

                try:
                    run()
                except Unsatisfiable:  # no way to violate the schema of an operation without inputs
                    assert mode is GenerationMode.NEGATIVE, where
    total = sum(counts.values())
    with capsys.disabled():  # the case count is part of the result: shown even when output is captured
        print(f"\nfuzz: {total} generated cases over {len(counts)} operation/mode pairs, no 5xx: {counts}")
    assert total >= MIN_CASES
    answer = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2



FIELD_EXAMPLES = 8  # per field and operation
BASE_BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
               "/v1/completions": {"prompt": "Hi", "max_tokens": 2}}


def value_strategy(schema: dict):
    """Values for the small JSON-schema subset these fields use (anyOf of object, string, array, boolean,
    integer), null left out: each case must set the field."""
    from hypothesis import strategies as st
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                               lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                            max_size=3), max_leaves=8)
    kinds = {"object": st.dictionaries(st.text(max_size=12), json_values, max_size=4),
             "string": st.text(max_size=24), "boolean": st.booleans(), "integer": st.integers(-3, 30)}
    options = []
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == "array":
            options.append(st.lists(value_strategy(option["items"]), max_size=3))
        elif option.get("type") in kinds:
            options.append(kinds[option["type"]])
    return st.one_of(options)


@pytest.mark.long
def test_fuzz_each_new_field(url, capsys):
    """Every new request field, alone on a minimal valid request, with generated values of its schema's
    types (shapes the server must reject as well as ones it accepts): no 5xx, OpenAI error objects."""
    from hypothesis import strategies as st
    openapi = httpx.get(url + "/openapi.json", timeout=30).json()
    counts: dict[str, int] = {}
    with requests.Session() as session:
        for path, names in NEW_FIELDS.items():
            ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            properties = openapi["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
            for name in names:
                @settings(max_examples=FIELD_EXAMPLES, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(value=value_strategy(properties[name]), stream=st.booleans())
                def run(value, stream) -> None:
                    body = {**BASE_BODIES[path], name: value, "stream": stream}
                    response = session.post(url + path, json=body, timeout=120)
                    counts[f"{path} {name}"] = counts.get(f"{path} {name}", 0) + 1
                    check_response(response.status_code, response.content,
                                   response.headers.get("content-type", ""), f"{path} {name}={value!r}")
                run()
    with capsys.disabled():
        print(f"\nfuzz: {sum(counts.values())} cases setting one new field each, no 5xx: {counts}")
    assert len(counts) == sum(map(len, NEW_FIELDS.values())) and min(counts.values()) >= FIELD_EXAMPLES // 2
