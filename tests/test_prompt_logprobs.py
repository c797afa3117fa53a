"""Prompt logprobs (`SamplingParams.prompt_logprobs`) on the real default model against transformers'
logits in fp32, with and without chunked prefill, on prefix-cache hits and mixed with plain requests."""
from __future__ import annotations

import math

import pytest
import torch

from minivllm import LLM, SamplingParams

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Then it runs into the forest and disappears.",
    "In 1905 Albert Einstein published four papers that changed physics: on the photoelectric effect, "
    "Brownian motion, special relativity and the equivalence of mass and energy.",
    "def add(a, b):\n    return a + b\n",
]
TOP = 3


@pytest.fixture(scope="module")
def unchunked() -> LLM:
    return LLM(kv_cache_memory=32 * 2**20, max_model_len=256, seed=0, enable_chunked_prefill=False,
               enable_prefix_caching=True)


@pytest.fixture(scope="module")
def prompt_ids(unchunked) -> list[list[int]]:
    return [unchunked.get_tokenizer().encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids) -> list[torch.Tensor]:
    """transformers' log-softmax over the vocabulary at each prompt position."""
    with torch.inference_mode():
        return [torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1) for ids in prompt_ids]


def check_against_reference(output, ids: list[int], ref: torch.Tensor, atol: float = 1e-3) -> None:
    prompt_logprobs = output.prompt_logprobs
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        entry, expected = prompt_logprobs[p], ref[p - 1]
        token = ids[p]
        assert math.isclose(entry[token].logprob, expected[token].item(), abs_tol=atol)
        assert entry[token].rank == int((expected >= expected[token]).sum())
        top_values, top_ids = expected.topk(TOP)
        for tid, value in zip(top_ids.tolist(), top_values.tolist()):
            assert math.isclose(entry[tid].logprob, value, abs_tol=atol)
        assert len(entry) in (TOP, TOP + 1)  # the prompt token may be among the top


def test_prompt_logprobs_match_transformers_unchunked(unchunked, prompt_ids, reference):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
    outputs = unchunked.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    for output, ids, ref in zip(outputs, prompt_ids, reference):
        check_against_reference(output, ids, ref)
    # The same prompts again: the prefix cache holds their blocks, but prompt logprobs still come whole.
    again = unchunked.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    for first, second in zip(outputs, again):
        assert second.num_cached_tokens == 0
        assert [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in first.prompt_logprobs] == \
               [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in second.prompt_logprobs]


def test_chunked_prefill_gives_the_same_prompt_logprobs(unchunked, prompt_ids, reference):
    """Chunks of 16 tokens, async scheduling, a plain request in the same batch and n = 2."""
    chunked = LLM(kv_cache_memory=32 * 2**20, max_model_len=256, seed=0, enable_chunked_prefill=True,
                  max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP, n=2)
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    engine = chunked.llm_engine
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"lp-{i}", ids, with_logprobs)
        engine.add_request(f"plain-{i}", ids, plain)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id.startswith("lp-"):
                assert output.prompt_logprobs is not None  # whole from the first output on
            else:
                assert output.prompt_logprobs is None
            if output.finished:
                finals[output.request_id] = output
    reference_outputs = unchunked.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                                           SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP))
    for i, (ids, ref) in enumerate(zip(prompt_ids, reference)):
        check_against_reference(finals[f"lp-{i}"], ids, ref)
        for p, (a, b) in enumerate(zip(finals[f"lp-{i}"].prompt_logprobs, reference_outputs[i].prompt_logprobs)):
            if a is not None:
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
        assert [c.token_ids for c in finals[f"lp-{i}"].outputs] == [reference_outputs[i].outputs[0].token_ids] * 2


def test_one_token_prompt_and_validation(unchunked):
    out = unchunked.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs == [None]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
