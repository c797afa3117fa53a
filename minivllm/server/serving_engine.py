"""What chat and completions serving share: model check, tokenization, length and token-id checks,
admission into the AsyncEngine (errors become OpenAI errors), and iterating request streams with
metrics and per-request logging. Talks only to the AsyncEngine.
"""
from __future__ import annotations

import asyncio
import copy
import json
import math
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from minivllm.engine.async_engine import AsyncEngine, RequestStream
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server import errors
from minivllm.server.limits import QueuedTokens, ServerLimits
from minivllm.server.metrics import ServerMetrics
from minivllm.server.protocol import ChatMessage, PromptTokensDetails, UsageInfo
from minivllm.server.tool_calling import template_messages


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready."""


def sse(data: str) -> str:
    return f"data: {data}\n\n"


class EventStreamResponse(StreamingResponse):
    """SSE response that always closes its generator, so a client hanging up aborts its requests now.

    Starlette cancels the sending task on disconnect; if that lands while the generator is parked at
    a `yield` the generator would only be closed by garbage collection.
    """

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class OpenAIServing:
    # Set by build_app to the server's (shared by chat and completions); these defaults limit nothing.
    limits = ServerLimits()
    queued_tokens = QueuedTokens(None)
    lora_modules = None   # server/lora.LoRAModules when LoRA is on: adapter names are models too

    def __init__(self, engine: AsyncEngine, served_model_names: list[str], metrics: ServerMetrics) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.metrics = metrics

    # ---- request checks ----------------------------------------------------------------------------
    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names and (self.lora_modules is None
                                                         or requested not in self.lora_modules.by_name):
            raise errors.model_not_found(requested)
        return requested

    @property
    def tokenizer(self):
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise errors.bad_request("this server runs without a tokenizer; only token-id prompts are accepted")
        return tokenizer

    def tokenize(self, text: str) -> list[int]:
        # The same call LLMEngine makes for text prompts, so server and offline API agree.
        return list(self.tokenizer.encode(text))

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
        """Apply the model's chat template (as `LLM.chat` does) and return the prompt token ids."""
        conversation = []
        for i, message in enumerate(messages):
            content = message.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise errors.bad_request(f"content parts of type {part.type!r} are not supported; "
                                                 "only text", param=f"messages.{i}.content")
                    parts.append(part.text)
                content = "\n".join(parts)
            entry = {"role": message.role, "content": content if content is not None else ""}
            if message.name is not None:
                entry["name"] = message.name
            if message.tool_calls:
                entry["tool_calls"] = copy.deepcopy(message.tool_calls)
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            conversation.append(entry)
        conversation = template_messages(conversation)
        if tools:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        try:
            ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, **(chat_template_kwargs or {}))
        except errors.OpenAIError:
            raise
        except Exception as e:  # a template that rejects the conversation (roles out of order, ...)
            raise errors.bad_request(f"cannot apply the chat template: {e}", param="messages") from None
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, what: str = "messages") -> None:
        max_len = self.engine.max_model_len
        if num_prompt_tokens == 0:
            raise errors.bad_request("the prompt is empty", param="prompt" if what == "prompt" else "messages")
        if num_prompt_tokens >= max_len:
            raise errors.bad_request(
                f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{num_prompt_tokens} input tokens. Please reduce the length of the input {what}.", param=what)
        if max_tokens is not None and num_prompt_tokens + max_tokens > max_len:
            raise errors.bad_request(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {what}, {max_tokens} in "
                f"the completion). Please reduce the length of the {what} or completion.", param="max_tokens")

    def check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in stop_token_ids / logit_bias index the vocabulary: out of range is bad input."""
        vocab_size = self.engine.vocab_size
        if vocab_size is None:
            return
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias or {}))):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise errors.bad_request(f"{name} has token ids outside [0, {vocab_size}): {bad[:5]}", param=name)

    # ---- running requests --------------------------------------------------------------------------
    async def admit(self, request_ids: Sequence[str], prompts: Sequence[list[int]], params: SamplingParams,
                    priority: int, model: str | None = None) -> list[RequestStream]:
        """Add every prompt of a request (under the LoRA adapter `model` names, if it names one); on any
        failure abort those already added and raise."""
        lora_request = None if self.lora_modules is None else self.lora_modules.by_name.get(model)
        extra = {} if lora_request is None else {"lora_request": lora_request}
        if priority != 0 and getattr(self.engine.config, "scheduling_policy", "priority") != "priority":
            raise errors.bad_request(f"priority {priority} needs the server to run with --scheduling-policy "
                                     "priority", param="priority")
        release = self.check_limits(prompts, params)
        arrival_time = time.monotonic()
        streams: list[RequestStream] = []
        try:
            for request_id, prompt in zip(request_ids, prompts):
                # Each sub-request gets its own params: the engine fills per-request fields in.
                sub_params = params if len(prompts) == 1 else copy.copy(params)
                streams.append(await self.engine.add_request(request_id, prompt, sub_params, priority=priority,
                                                             arrival_time=arrival_time, **extra))
        except BaseException as e:
            release()
            for stream in streams:
                stream.close()
            if isinstance(e, Exception):
                raise errors.from_exception(e) from None
            raise
        QueuedTokens.attach(release, streams)
        return streams

    def check_limits(self, prompts: Sequence[list[int]], params: SamplingParams):
        """The default max_tokens clamped to the cap (what a request asks for was checked by the route
        against `limits.check_request`), then the queued-token budget (429); returns its release."""
        cap = self.limits.max_tokens_limit
        if cap is not None and (params.max_tokens is None or params.max_tokens > cap):
            params.max_tokens = cap
        max_len = self.engine.max_model_len
        amount = sum(len(p) + params.n * (params.max_tokens or max(max_len - len(p), 0)) for p in prompts)
        return self.queued_tokens.reserve(amount)

    async def iterate(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) pairs from all streams as they come; tracks metrics.

        Closing this generator (or cancelling its consumer) aborts every unfinished request.
        """
        trackers = [self.metrics.track(s.request_id) for s in streams]
        pumps: list[asyncio.Task] = []
        timeout = self.limits.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout

        async def within_deadline(awaitable):
            if deadline is None:
                return await awaitable
            try:
                return await asyncio.wait_for(awaitable, max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise errors.request_timeout(timeout) from None

        try:
            if len(streams) == 1:
                while True:
                    try:
                        output = await within_deadline(anext(streams[0]))
                    except StopAsyncIteration:
                        break
                    trackers[0].on_output(output)
                    yield 0, output
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, stream: RequestStream) -> None:
                try:
                    async for output in stream:
                        queue.put_nowait((i, output))
                    queue.put_nowait((i, None))
                except BaseException as e:  # forwarded to the consumer, which re-raises it
                    queue.put_nowait((i, e))

            pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
            remaining = len(streams)
            while remaining:
                i, item = await within_deadline(queue.get())
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    trackers[i].on_output(item)
                    yield i, item
        finally:
            for task in pumps:
                task.cancel()
            for stream in streams:
                stream.close()
                getattr(stream, "release_tokens", lambda: None)()
            for tracker in trackers:
                tracker.on_close()

    async def collect(self, streams: list[RequestStream], raw_request: Request | None) -> list[RequestOutput]:
        """The final output of each stream; aborts everything if the client disconnects meanwhile."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        outputs = self.iterate(streams)
        try:
            async for i, output in outputs:
                finals[i] = output
                if raw_request is not None and await raw_request.is_disconnected():
                    raise ClientDisconnected()
        except ClientDisconnected:
            raise errors.OpenAIError(499, "client disconnected", "invalid_request_error") from None
        except errors.OpenAIError:
            raise
        except Exception as e:
            raise errors.from_exception(e) from None
        finally:
            await outputs.aclose()
        assert all(f is not None and f.finished for f in finals), "a stream ended without a finished output"
        return finals

    @staticmethod
    def usage(outputs: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def stream_error(self, error: BaseException) -> str:
        """An error after the 200 headers went out: an SSE event with the error object, as vLLM does."""
        return sse(json.dumps(errors.from_exception(error).to_dict()))


def finite_logprob(value: float) -> float:
    """JSON has no -inf: a masked-out candidate gets a very negative number instead, as in vLLM."""
    return value if math.isfinite(value) else -9999.0


def decode_token(tokenizer, token_id: int, decoded: str | None) -> str:
    if decoded is not None:
        return decoded
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
