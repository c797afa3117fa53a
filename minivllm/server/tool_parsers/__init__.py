"""Tool-call parsers: a model's raw text -> (content, tool calls), one per output format, chosen with
`--tool-call-parser` as in vLLM. Each parser also says where a tool call may begin, so streaming can send
the text before it as content and hold back the rest until the call is complete."""
from minivllm.server.tool_parsers.parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedToolCall,
    ToolParser,
    get_tool_parser,
)

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "ParsedToolCall",
           "ToolParser", "get_tool_parser"]
