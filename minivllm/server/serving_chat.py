"""POST /v1/chat/completions: chat template -> engine -> chat.completion or chat.completion.chunk SSE."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from minivllm.engine.async_engine import RequestStream
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.server import errors
from minivllm.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    FunctionCall,
    ToolCall,
    TopLogprob,
)
from minivllm.server.serving_engine import EventStreamResponse, OpenAIServing, decode_token, finite_logprob, sse
from minivllm.server.tool_calling import ToolCallPlan, ToolCallStream, ToolRequestError, plan_tool_calls, tool_call_id
from minivllm.server.tool_parsers import get_tool_parser


def _finish_reason(completion: CompletionOutput, calls: list, tools: ToolCallPlan | None) -> str | None:
    # OpenAI: "tool_calls" when the model chose to call (auto, required); a forced named call ends with "stop".
    if calls and completion.finish_reason == "stop" and tools.mode in ("auto", "required"):
        return "tool_calls"
    return completion.finish_reason


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False) -> None:
        super().__init__(*args)
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)  # an unknown name fails at startup, not per request
        self.tool_call_parser, self.enable_auto_tool_choice = tool_call_parser, enable_auto_tool_choice

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        model = self.model_name(request.model)
        try:
            tools = plan_tool_calls(request.tools, request.tool_choice, self.tool_call_parser,
                                    self.enable_auto_tool_choice)
        except ToolRequestError as e:
            raise errors.bad_request(str(e), param=e.param) from None
        prompt_ids = self.render_chat(request.messages, request.add_generation_prompt, request.chat_template_kwargs,
                                      tools.tools if tools else None)
        try:
            # Without max_tokens a chat reply may use the whole rest of the context, as in vLLM.
            params = request.to_sampling_params(default_max_tokens=max(1, self.engine.max_model_len - len(prompt_ids)))
            if tools is not None and tools.structured_outputs is not None:
                if params.structured_outputs is not None:
                    raise ValueError("tool_choice required or named cannot be combined with another structured output")
                params.structured_outputs = tools.structured_outputs
        except ValueError as e:
            raise errors.from_exception(e) from None
        self.check_length(len(prompt_ids), params.max_tokens, "messages")
        self.check_token_ids(params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.admit([request_id], [prompt_ids], params, request.priority, model)
        created = int(time.time())
        if request.stream:
            return EventStreamResponse(self._stream(request, request_id, created, model, streams, tools))
        [final] = await self.collect(streams, raw_request)
        choices = []
        for c in final.outputs:
            content, calls = tools.parse(c.text) if tools is not None else (c.text, [])
            message = ChatResponseMessage(content=content, tool_calls=[
                ToolCall(id=tool_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
                for call in calls])
            choices.append(ChatCompletionChoice(
                index=c.index, message=message,
                logprobs=self._logprobs(c, 0, request.top_logprobs) if request.logprobs else None,
                finish_reason=_finish_reason(c, calls, tools), stop_reason=c.stop_reason))
        response = ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                          usage=self.usage([final]))
        return JSONResponse(response.model_dump())

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int, model: str,
                      streams: list[RequestStream], tools: ToolCallPlan | None) -> AsyncIterator[str]:
        include_usage = request.include_usage

        def chunk(choices: list[ChatCompletionStreamChoice], usage=None) -> str:
            response = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                                    usage=usage)
            return sse(response.model_dump_json(exclude=None if include_usage else {"usage"}))

        sent_text = [0] * request.n
        sent_tokens = [0] * request.n
        tool_streams = [ToolCallStream(tools) for _ in range(request.n)] if tools and tools.mode != "none" else None
        outputs = self.iterate(streams)
        try:
            # OpenAI's first delta of each choice carries the role and no text.
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(request.n)])
            final: RequestOutput | None = None
            async for _, output in outputs:
                final = output
                choices = []
                for c in output.outputs:
                    i = c.index
                    delta_text = c.text[sent_text[i]:]
                    new_tokens = len(c.token_ids) - sent_tokens[i]
                    if not new_tokens and c.finish_reason is None:
                        continue
                    logprobs = self._logprobs(c, sent_tokens[i], request.top_logprobs) if request.logprobs else None
                    sent_text[i] = len(c.text)
                    sent_tokens[i] = len(c.token_ids)
                    delta, finish_reason = DeltaMessage(content=delta_text), c.finish_reason
                    if tool_streams is not None:
                        delta, calls = tool_streams[i].delta(c.text, c.finished)
                        finish_reason = _finish_reason(c, calls, tools)
                    choices.append(ChatCompletionStreamChoice(
                        index=i, delta=delta, logprobs=logprobs,
                        finish_reason=finish_reason, stop_reason=c.stop_reason))
                if choices:
                    yield chunk(choices, self.usage([output]) if request.continuous_usage else None)
            if include_usage and final is not None:
                yield chunk([], usage=self.usage([final]))
            yield sse("[DONE]")
        except Exception as e:  # the 200 is already sent: report in-band, then end the stream
            yield self.stream_error(e)
            yield sse("[DONE]")
        finally:
            await outputs.aclose()

    def _logprobs(self, completion: CompletionOutput, start: int, top_n: int | None) -> ChatChoiceLogprobs:
        """OpenAI chat logprobs for the completion's tokens from `start` on."""
        tokenizer = self.engine.tokenizer
        content = []
        entries = completion.logprobs or []
        for token_id, candidates in zip(completion.token_ids[start:], entries[start:]):
            chosen = candidates[token_id]
            token = decode_token(tokenizer, token_id, chosen.decoded_token)
            ranked = sorted(candidates.items(), key=lambda kv: -kv[1].logprob)[:top_n or 0]
            top = []
            for tid, lp in ranked:
                text = decode_token(tokenizer, tid, lp.decoded_token)
                top.append(TopLogprob(token=text, logprob=finite_logprob(lp.logprob),
                                      bytes=list(text.encode("utf-8"))))
            content.append(ChatTokenLogprob(token=token, logprob=finite_logprob(chosen.logprob),
                                            bytes=list(token.encode("utf-8")), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)
