"""OpenAI API schemas (pydantic v2): the requests the server accepts and the objects it returns.

Field names follow OpenAI's API plus vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, priority, ...). Range checks that `SamplingParams` already makes are left to it, so
the offline API and the server reject bad values with the same message. Unknown fields are ignored,
as OpenAI and vLLM do; fields that would change the meaning of a request but are not supported
(suffix, ...) are rejected by the serving code.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from minivllm.sampling_params import SamplingParams, StructuredOutputsParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- requests ------------------------------------------------------------------------------------

class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (tokens so far) in every chunk


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None                 # a tool turn: the call it answers


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and completions requests."""
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields and their newer spelling.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one grammar the request asks for (ValueError if several, or a malformed one)."""
        specs: list[StructuredOutputsParams] = []
        response_format = self.response_format or {}
        kind = response_format.get("type", "text")
        if kind == "json_object":
            specs.append(StructuredOutputsParams(json_object=True))
        elif kind == "json_schema":
            json_schema = response_format.get("json_schema")
            schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
            if not isinstance(schema, (dict, str)):
                raise ValueError("response_format json_schema needs a `json_schema.schema` object")
            specs.append(StructuredOutputsParams(json=schema))
        elif kind != "text":
            raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                specs.append(StructuredOutputsParams(**{name: value}))
        if self.structured_outputs:
            try:
                specs.append(StructuredOutputsParams(**self.structured_outputs))
            except TypeError:
                raise ValueError("structured_outputs takes one of json, regex, choice, grammar, json_object") from None
        if len(specs) > 1:
            raise ValueError("give one of response_format, guided_json, guided_regex, guided_choice, "
                             "guided_grammar or structured_outputs")
        return specs[0] if specs else None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the bad field (the caller turns it into a 400)."""
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers as strings)") from None
            if any(not -100.0 <= v <= 100.0 for v in logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")

        def pick(value, default):
            return default if value is None else value

        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0), min_p=pick(self.min_p, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0), logit_bias=logit_bias,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted so that clients sending their defaults work; anything but "no" is rejected.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(default_max_tokens if max_tokens is None else max_tokens, logprobs)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return self._sampling_params(default_max_tokens if self.max_tokens is None else self.max_tokens,
                                     self.logprobs)


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# ---- responses -----------------------------------------------------------------------------------

class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

    def extend(self, other: CompletionLogprobs) -> CompletionLogprobs:
        """These entries followed by `other`'s (echoed prompt, then the completion)."""
        return CompletionLogprobs(text_offset=self.text_offset + other.text_offset,
                                  token_logprobs=self.token_logprobs + other.token_logprobs,
                                  tokens=self.tokens + other.tokens, top_logprobs=self.top_logprobs + other.top_logprobs)


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    # OpenAI's streamed tool calls: {"index", then in the first delta of a call "id", "type" and
    # "function": {"name", "arguments": ""}, in later ones "function": {"arguments": piece}}.
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # OpenAI sends `role` only in a choice's first delta; absent, not null, afterwards.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: str | None = None
    parent: str | None = None          # a LoRA adapter's base model
    max_model_len: int | None = None
    quantization: str | None = None   # the weights' format (gptq, awq, fp8, ...), None when unquantized


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo
