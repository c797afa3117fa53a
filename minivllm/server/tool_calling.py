"""Tool calling on /v1/chat/completions: what `tools` and `tool_choice` do to the prompt and to sampling,
and how a reply becomes OpenAI `tool_calls`, whole or as streamed deltas.

- `none`: the template still sees the tools (as in vLLM); the reply is plain content.
- `auto` (OpenAI's default when tools are given): needs `--enable-auto-tool-choice` and a
  `--tool-call-parser`; the parser finds calls in the free reply.
- `required`: a grammar forces a JSON array of `{"name": one of the tools, "parameters": its schema}`.
- a named function: a grammar forces that function's arguments object; the reply is the arguments.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.server.protocol import DeltaMessage
from minivllm.server.tool_parsers import ParsedToolCall, ToolParser, get_tool_parser


class ToolRequestError(ValueError):
    """Bad `tools` or `tool_choice`; `param` names which."""

    def __init__(self, message: str, param: str = "tool_choice") -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolCallPlan:
    mode: str                       # "none", "auto", "required" or "named"
    tools: list[dict]               # as the chat template takes them
    parser: ToolParser | None = None
    named: str | None = None
    structured_outputs: StructuredOutputsParams | None = field(default=None, repr=False)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, tool calls) of a finished reply."""
        if self.mode == "named":
            return None, [ParsedToolCall(self.named, text)]
        if self.mode == "required":
            try:
                calls = [ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                         for c in json.loads(text)]
            except (json.JSONDecodeError, KeyError, TypeError):  # cut by max_tokens
                return text, []
            return None, calls
        if self.mode == "auto":
            return self.parser.extract(text)
        return text, []


def plan_tool_calls(tools: list[dict] | None, tool_choice, parser_name: str | None,
                    enable_auto_tool_choice: bool) -> ToolCallPlan | None:
    """ToolRequestError (a 400) for tools or a choice this server cannot honour."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolRequestError("tool_choice needs tools")
        return None
    functions = {}
    for tool in tools:
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("parameters") or {}, dict):
            raise ToolRequestError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                                   "\"parameters\": {...}}}", param="tools")
        functions[function["name"]] = function
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in functions:
            raise ToolRequestError(f"tool_choice names function {name!r}, which is not among the tools")
        return ToolCallPlan("named", tools, named=name,
                            structured_outputs=StructuredOutputsParams(json=_parameters(functions[name])))
    if choice == "none":
        return ToolCallPlan("none", tools)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _parameters(f)},
                  "required": ["name", "parameters"]} for name, f in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        return ToolCallPlan("required", tools, structured_outputs=StructuredOutputsParams(json=schema))
    if choice != "auto":
        raise ToolRequestError(f"tool_choice must be none, auto, required or a named function, got {choice!r}")
    if not enable_auto_tool_choice or parser_name is None:
        raise ToolRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    return ToolCallPlan("auto", tools, parser=get_tool_parser(parser_name))


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with their arguments as objects, as chat templates iterate them."""
    for message in messages:
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass
    return messages


class ToolCallStream:
    """One streamed choice: content deltas until a tool call may begin, then OpenAI's `tool_calls` deltas.

    A named call streams its arguments as they are generated; `required` and `auto` calls are sent when
    the reply is complete (a name and arguments delta per call), since only then do they parse.
    """

    def __init__(self, plan: ToolCallPlan) -> None:
        self.plan = plan
        self.sent = 0          # characters of the reply already sent (as content or named arguments)
        self.started = False   # the named call's first delta went out

    def delta(self, text: str, finished: bool):
        """(DeltaMessage for the new text, the parsed calls once finished)."""
        plan = self.plan
        if plan.mode == "named":
            calls = [{"index": 0, "function": {"arguments": text[self.sent:]}}]
            if not self.started:
                calls[0].update(id=tool_call_id(), type="function")
                calls[0]["function"]["name"] = plan.named
                self.started = True
            self.sent = len(text)
            return DeltaMessage(tool_calls=calls), plan.parse(text)[1] if finished else []
        if not finished:
            safe = plan.parser.safe_prefix(text) if plan.mode == "auto" else 0
            content, self.sent = text[self.sent:safe], max(self.sent, safe)
            return DeltaMessage(content=content), []
        content, calls = plan.parse(text)
        if not calls:
            rest, self.sent = text[self.sent:], len(text)
            return DeltaMessage(content=rest), []
        rest = (content or "")[self.sent:]
        deltas = [{"index": k, "id": tool_call_id(), "type": "function",
                   "function": {"name": call.name, "arguments": call.arguments}} for k, call in enumerate(calls)]
        return DeltaMessage(content=rest or None, tool_calls=deltas), calls
