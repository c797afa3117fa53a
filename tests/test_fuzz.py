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

