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
    TopLogprob,
)
from minivllm.server.serving_engine import EventStreamResponse, OpenAIServing, decode_token, finite_logprob, sse


def _unsupported(request: ChatCompletionRequest) -> str | None:
    if request.tools:
        return "tools"
    if request.tool_choice not in (None, "none"):
        return "tool_choice"
    return None


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        model = self.model_name(request.model)
        if (field := _unsupported(request)) is not None:
            raise errors.bad_request(f"{field} is not supported by this server", param=field)
        prompt_ids = self.render_chat(request.messages, request.add_generation_prompt, request.chat_template_kwargs)
        try:
            # Without max_tokens a chat reply may use the whole rest of the context, as in vLLM.
            params = request.to_sampling_params(default_max_tokens=max(1, self.engine.max_model_len - len(prompt_ids)))
        except ValueError as e:
            raise errors.from_exception(e) from None
        self.check_length(len(prompt_ids), params.max_tokens, "messages")
        self.check_token_ids(params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.admit([request_id], [prompt_ids], params, request.priority)
        created = int(time.time())
        if request.stream:
            return EventStreamResponse(self._stream(request, request_id, created, model, streams))
        [final] = await self.collect(streams, raw_request)
        choices = [ChatCompletionChoice(
            index=c.index, message=ChatResponseMessage(content=c.text),
            logprobs=self._logprobs(c, 0, request.top_logprobs) if request.logprobs else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in final.outputs]
        response = ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                          usage=self.usage([final]))
        return JSONResponse(response.model_dump())

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int, model: str,
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        include_usage = request.include_usage

        def chunk(choices: list[ChatCompletionStreamChoice], usage=None) -> str:
            response = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                                    usage=usage)
            return sse(response.model_dump_json(exclude=None if include_usage else {"usage"}))

        sent_text = [0] * request.n
        sent_tokens = [0] * request.n
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
                    choices.append(ChatCompletionStreamChoice(
                        index=i, delta=DeltaMessage(content=delta_text), logprobs=logprobs,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason))
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
