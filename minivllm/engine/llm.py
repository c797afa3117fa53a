"""LLM: the offline API, as vLLM users know it — `LLM(model).generate(prompts, params)` and `.chat(...)`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from minivllm.config import EngineConfig
from minivllm.engine.gc_heap import frozen_heap
from minivllm.engine.llm_engine import LLMEngine
from minivllm.lora.request import LoRARequest
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict


def _normalize_prompts(prompts) -> list[str | list[int]]:
    """Accept a string, a token-id list, {"prompt": ...} / {"prompt_token_ids": ...}, or a list of any of these."""
    def one(p) -> str | list[int]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"])
            if "prompt" in p:
                return p["prompt"]
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            return p
        raise ValueError(f"unsupported prompt type {type(p).__name__}")

    if isinstance(prompts, (str, dict)):
        return [one(prompts)]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, Seq):
        return [one(p) for p in prompts]
    raise ValueError(f"unsupported prompts type {type(prompts).__name__}")


class LLM:
    """Batch generation over an `LLMEngine`; keyword arguments are `EngineConfig` fields (vLLM names)."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        lora_list = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompt_list)
        if len(lora_list) != len(prompt_list):
            raise ValueError(f"got {len(lora_list)} LoRA requests for {len(prompt_list)} prompts")
        request_ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params,
                                            priority=priority[i] if priority is not None else 0,
                                            lora_request=lora_list[i])
                request_ids.append(request_id)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            # Bad input (or an interrupt) must not leave half a batch inside the engine.
            self.llm_engine.abort_request(request_ids)
            raise

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            if not conversation:
                raise ValueError("a conversation needs at least one message")
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                tokenize=True, return_dict=False, **(chat_template_kwargs or {}))
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with frozen_heap(), tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(finished) < len(wanted) and self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[r] for r in request_ids]
