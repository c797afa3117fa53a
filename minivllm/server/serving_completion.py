"""POST /v1/completions: prompt(s) -> engine -> text_completion object or SSE chunks.

A request may carry several prompts (a list of strings or of token-id lists); each becomes its own
engine request and its choices are numbered `prompt_index * n + sample_index`, as in OpenAI's API.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from minivllm.engine.async_engine import RequestStream
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.server import errors
from minivllm.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from minivllm.server.serving_engine import EventStreamResponse, OpenAIServing, decode_token, finite_logprob, sse


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, request: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        """Token ids and (for echo) text of every prompt in the request."""
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise errors.bad_request("the prompt is empty", param="prompt")
        token_ids, texts = [], []
        for p in prompt:
            if isinstance(p, str):
                token_ids.append(self.tokenize(p) if p else [])
                texts.append(p)
            else:
                token_ids.append(list(p))
                texts.append(None)
        return token_ids, texts

    async def create_completion(self, request: CompletionRequest, raw_request: Request):
        model = self.model_name(request.model)
        if request.suffix:
            raise errors.bad_request("suffix is not supported by this server", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise errors.bad_request("best_of must equal n (beam-like best_of is not supported)", param="best_of")
        prompt_ids, prompt_texts = self._prompts(request)
        try:
            params = request.to_sampling_params(default_max_tokens=max(
                1, self.engine.max_model_len - max(len(p) for p in prompt_ids)))
        except ValueError as e:
            raise errors.from_exception(e) from None
        if request.echo and request.logprobs is not None:
            params.prompt_logprobs = params.logprobs  # echo scores the prompt too (lm-eval's loglikelihood)
        for ids in prompt_ids:
            self.check_length(len(ids), params.max_tokens, "prompt")
        self.check_token_ids(params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        sub_ids = [request_id] if len(prompt_ids) == 1 else [f"{request_id}-{i}" for i in range(len(prompt_ids))]
        streams = await self.admit(sub_ids, prompt_ids, params, request.priority, model)
        created = int(time.time())
        echo = [self._echo_text(text, ids) if request.echo else "" for text, ids in zip(prompt_texts, prompt_ids)]
        if request.stream:
            return EventStreamResponse(self._stream(request, request_id, created, model, streams, echo))
        finals = await self.collect(streams, raw_request)
        choices = []
        for i, final in enumerate(finals):
            for c in final.outputs:
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(c, 0, len(echo[i]))
                    if request.echo:
                        logprobs = self._prompt_logprobs(final).extend(logprobs)
                choices.append(CompletionChoice(index=i * request.n + c.index, text=echo[i] + c.text,
                                                logprobs=logprobs, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason))
        response = CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=self.usage(finals))
        return JSONResponse(response.model_dump())

    def _echo_text(self, text: str | None, token_ids: list[int]) -> str:
        if text is not None:
            return text
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(token_ids) if tokenizer is not None else ""

    async def _stream(self, request: CompletionRequest, request_id: str, created: int, model: str,
                      streams: list[RequestStream], echo: list[str]) -> AsyncIterator[str]:
        include_usage = request.include_usage
        n = request.n
        num_choices = len(streams) * n
        sent_text = [0] * num_choices
        sent_tokens = [0] * num_choices
        text_offset = [len(echo[k // n]) for k in range(num_choices)]
        echoed = [not echo[k // n] for k in range(num_choices)]
        finals: list[RequestOutput | None] = [None] * len(streams)

        def chunk(choices: list[CompletionChoice], usage=None) -> str:
            response = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
            return sse(response.model_dump_json(exclude=None if include_usage else {"usage"}))

        outputs = self.iterate(streams)
        try:
            async for prompt_index, output in outputs:
                finals[prompt_index] = output
                choices = []
                for c in output.outputs:
                    k = prompt_index * n + c.index
                    delta_text = c.text[sent_text[k]:]
                    new_tokens = len(c.token_ids) - sent_tokens[k]
                    if not new_tokens and c.finish_reason is None and echoed[k]:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._logprobs(c, sent_tokens[k], text_offset[k])
                        if logprobs.tokens:
                            text_offset[k] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                        if request.echo and not echoed[k]:
                            logprobs = self._prompt_logprobs(output).extend(logprobs)
                    prefix = "" if echoed[k] else echo[prompt_index]
                    echoed[k] = True
                    sent_text[k] = len(c.text)
                    sent_tokens[k] = len(c.token_ids)
                    choices.append(CompletionChoice(index=k, text=prefix + delta_text, logprobs=logprobs,
                                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
                if choices:
                    yield chunk(choices, self.usage([output]) if request.continuous_usage else None)
            if include_usage and all(f is not None for f in finals):
                yield chunk([], usage=self.usage(finals))
            yield sse("[DONE]")
        except Exception as e:  # the 200 is already sent: report in-band, then end the stream
            yield self.stream_error(e)
            yield sse("[DONE]")
        finally:
            await outputs.aclose()

    def _prompt_logprobs(self, output: RequestOutput) -> CompletionLogprobs:
        """The echoed prompt's tokens in OpenAI's format: the first token has no logprob (None)."""
        tokenizer = self.engine.tokenizer
        result, offset = CompletionLogprobs(), 0
        for token_id, candidates in zip(output.prompt_token_ids, output.prompt_logprobs or []):
            decoded = candidates[token_id].decoded_token if candidates else None
            token = decode_token(tokenizer, token_id, decoded)
            result.tokens.append(token)
            result.token_logprobs.append(None if candidates is None else finite_logprob(candidates[token_id].logprob))
            result.top_logprobs.append(None if candidates is None else {
                decode_token(tokenizer, tid, lp.decoded_token): finite_logprob(lp.logprob)
                for tid, lp in candidates.items()})
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def _logprobs(self, completion: CompletionOutput, start: int, offset: int) -> CompletionLogprobs:
        """OpenAI completions logprobs for the tokens from `start` on; text offsets begin at `offset`."""
        tokenizer = self.engine.tokenizer
        result = CompletionLogprobs()
        entries = completion.logprobs or []
        for token_id, candidates in zip(completion.token_ids[start:], entries[start:]):
            chosen = candidates[token_id]
            token = decode_token(tokenizer, token_id, chosen.decoded_token)
            result.tokens.append(token)
            result.token_logprobs.append(finite_logprob(chosen.logprob))
            result.top_logprobs.append({decode_token(tokenizer, tid, lp.decoded_token): finite_logprob(lp.logprob)
                                        for tid, lp in candidates.items()})
            result.text_offset.append(offset)
            offset += len(token)
        return result
