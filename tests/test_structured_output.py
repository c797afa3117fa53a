"""Structured outputs offline: the sampler's bitmask against a boolean-mask reference, and the real default
model constrained by JSON schemas, choices, regexes and EBNF, mixed with unconstrained requests."""
from __future__ import annotations

import json
import math
import re

import jsonschema
import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.layers.sampler import apply_token_bitmask
from minivllm.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z .'-]{1,20}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "string", "pattern": "^[a-z ]{1,10}$"}, "maxItems": 2},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "pets", "color", "address"],
}
CHATS = [[{"role": "user", "content": c}] for c in (
    "Describe a person as JSON.", "Make up a character who lives in Rome.")]


def test_token_bitmask_matches_a_boolean_mask():
    generator = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partly padding
    allowed = torch.rand(5, vocab, generator=generator) < 0.3
    padded = torch.zeros(5, 96, dtype=torch.bool)
    padded[:, :vocab] = allowed
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    words = (padded.view(5, 3, 32).long() * weights).sum(-1)
    bitmask = torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))
    logits = torch.randn(5, vocab, generator=generator)
    expected = logits.masked_fill(~allowed, -math.inf)
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask), expected)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=64 << 20, max_model_len=1024, seed=0, async_scheduling=True)


@pytest.mark.long
def test_json_schema_choice_regex_grammar_mixed_with_plain_requests(llm):
    schema = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    sampled = SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=120,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)))
    choice = SamplingParams(temperature=1.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "not sure"]))
    regex = SamplingParams(temperature=1.0, max_tokens=12,
                           structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"))
    grammar = SamplingParams(temperature=1.0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'))
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    requests = [(c, p) for c in CHATS for p in (schema, sampled, choice, regex, grammar, plain)]
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False)} for c, _ in requests]
    outputs = llm.generate(prompts, [p for _, p in requests], use_tqdm=False)
    alone = llm.generate([p for p, (_, params) in zip(prompts, requests) if params is plain], plain, use_tqdm=False)
    plain_outputs = []
    for output, (_, params) in zip(outputs, requests):
        for completion in output.outputs:
            text = completion.text
            if params in (schema, sampled):
                assert completion.finish_reason == "stop"
                jsonschema.validate(json.loads(text), SCHEMA)
            elif params is choice:
                assert text in ("yes", "no", "not sure")
            elif params is regex:
                assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
            elif params is grammar:
                assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)?", text), text
            else:
                plain_outputs.append(completion.token_ids)
    # Constrained rows in the batch leave the unconstrained ones untouched.
    assert plain_outputs == [o.outputs[0].token_ids for o in alone]
    assert len({o.outputs[0].text for o, (_, p) in zip(outputs, requests) if p is sampled} |
               {o.outputs[1].text for o, (_, p) in zip(outputs, requests) if p is sampled}) > 1


def test_bad_specifications_are_value_errors(llm):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="invalid structured output"):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(json="{not json")),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="invalid structured output"):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= ")),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
