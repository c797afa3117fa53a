"""Tool-call parsers on the formats each family emits, and streamed deltas reassembling to the whole parse."""
from __future__ import annotations

import json

import pytest

from minivllm.server.tool_calling import ToolCallStream, plan_tool_calls
from minivllm.server.tool_parsers import get_tool_parser

CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"city": "Tokyo"})]
FORMATS = {
    "hermes": "Let me check.\n" + "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in CALLS),
    "llama3_json": "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS),
    "mistral": "Let me check.[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in CALLS]),
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n, _ in CALLS]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_parses_and_streams_to_the_same_calls(name):
    parser = get_tool_parser(name)
    text = FORMATS[name]
    content, calls = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert content == (None if name == "llama3_json" else "Let me check.\n" if name == "hermes" else "Let me check.")
    # Stream it a few characters at a time: content deltas, then one tool-call delta per call.
    stream = ToolCallStream(plan_tool_calls(TOOLS, "auto", name, True))
    streamed_content, streamed_calls = "", []
    for end in list(range(3, len(text), 3)) + [len(text)]:
        delta, _ = stream.delta(text[:end], finished=end == len(text))
        assert not any(marker in (delta.content or "") for marker in ("<tool_call>", "[TOOL_CALLS]", "{"))
        streamed_content += delta.content or ""
        streamed_calls += delta.tool_calls or []
    assert streamed_content == (content or "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed_calls] == CALLS


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_plain_replies_and_broken_calls_stay_content(name):
    parser = get_tool_parser(name)
    for text in ("The weather in Paris is mild.", "<tool_call>{not json</tool_call>", "[TOOL_CALLS][{\"x\": 1}]"):
        assert parser.extract(text) == (text, [])


def test_unknown_parser_and_auto_without_flags_are_errors():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="enable-auto-tool-choice"):
        plan_tool_calls(TOOLS, "auto", None, False)
