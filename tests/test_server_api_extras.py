"""The API fields vLLM users rely on beyond plain sampling, through the official `openai` SDK against one
live server on the default model: echo + logprobs (prompt logprobs) on /v1/completions."""
from __future__ import annotations

import math
from types import SimpleNamespace

import openai
import pytest

from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.server.api_server import ServerThread, build_app

PROMPT = "Paris is the capital of France, and Berlin is the capital of"


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=64 << 20, max_model_len=1024)


@pytest.fixture(scope="module")
def offline(llm):
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, prompt_logprobs=1)
    return SimpleNamespace(echo=llm.generate([PROMPT], params, use_tqdm=False)[0])


@pytest.fixture(scope="module")
def client(llm, offline):
    thread = ServerThread(build_app(AsyncEngine(llm.llm_engine)))
    url = thread.start()
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    thread.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_are_the_offline_prompt_logprobs(client, offline, stream):
    ref = offline.echo
    kwargs = dict(model="", prompt=PROMPT, max_tokens=2, temperature=0.0, echo=True, logprobs=1)
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        logprobs = SimpleNamespace(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for c in chunks:
            if c.choices and c.choices[0].logprobs:
                for field in vars(logprobs):
                    getattr(logprobs, field).extend(getattr(c.choices[0].logprobs, field))
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, logprobs = choice.text, choice.logprobs
    assert text == PROMPT + ref.outputs[0].text
    num_prompt = len(ref.prompt_token_ids)
    assert len(logprobs.tokens) == num_prompt + 2
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [ref.prompt_logprobs[p][t].logprob for p, t in enumerate(ref.prompt_token_ids) if p] + \
               [d[t].logprob for d, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(logprobs.token_logprobs[1:], expected))
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens[:num_prompt]) == PROMPT
