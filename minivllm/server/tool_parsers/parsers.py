"""The formats the supported families emit:

- hermes (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
- llama3_json (Llama 3.x): the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`, several separated by `;`);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

A reply that does not parse as tool calls is plain content, as in vLLM.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


def _call(obj, arguments_key: str = "arguments") -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models emit the arguments already serialised
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _content(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser:
    """Base: a marker that starts the tool calls; subclasses parse what follows it."""
    marker = ""

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = self._parse(text[start + len(self.marker):])
        if not calls:
            return text, []
        return _content(text[:start]), calls

    def _parse(self, rest: str) -> list[ParsedToolCall]:
        raise NotImplementedError

    def safe_prefix(self, text: str) -> int:
        """How much of `text` is content for sure: everything before the marker or a partial marker at the end."""
        start = text.find(self.marker)
        if start >= 0:
            return start
        for keep in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class HermesToolParser(ToolParser):
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _parse(self, rest: str) -> list[ParsedToolCall]:
        calls = []
        for body in self._block.findall(self.marker + rest):
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                return []
            if call is None:
                return []
            calls.append(call)
        return calls


class MistralToolParser(ToolParser):
    marker = "[TOOL_CALLS]"

    def _parse(self, rest: str) -> list[ParsedToolCall]:
        try:
            value = json.loads(rest.strip())
        except json.JSONDecodeError:
            return []
        calls = [_call(v) for v in (value if isinstance(value, list) else [value])]
        return calls if calls and all(calls) else []


class Llama3JsonToolParser(ToolParser):
    marker = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = text.strip()
        if body.startswith(self.marker):
            body = body[len(self.marker):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call(value, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return None, calls

    def safe_prefix(self, text: str) -> int:
        # The whole reply is the call: hold everything that may still become one.
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or self.marker.startswith(stripped[:len(self.marker)]):
            return 0
        return len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (choose {', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]()
