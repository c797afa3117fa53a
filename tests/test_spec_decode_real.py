"""Speculative decoding on the real default model (CPU, fp32): greedy output identical to no speculation
for every proposer (suffix decoding under batching, preemption and prefix hits), and a suffix-decoding
server driven by the openai SDK (streaming, usage, metrics)."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minivllm import LLM, SamplingParams
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server.api_server import ServerThread, build_app

SETTINGS = dict(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024, seed=0)
TEXT = ("The lighthouse keeper climbed the stairs every evening at dusk. He lit the lamp, wiped the glass, "
        "and wrote the weather in his logbook before the ships came past the rocks.")
CHATS = [
    [{"role": "user", "content": f"Repeat this text word for word: {TEXT}"}],
    [{"role": "user", "content": f"Summarise in one sentence: {TEXT}"}],
    [{"role": "user", "content": "Rewrite this code with better names:\ndef f(a, b):\n    c = a + b\n    return c * c\n"}],
    [{"role": "user", "content": "What is the capital of France?"}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "draft_layers": {"method": "draft_model", "draft_layers": 20, "num_speculative_tokens": 3, "adaptive": False},
}


@pytest.fixture(scope="module")
def plain():
    return LLM(**SETTINGS)


@pytest.fixture(scope="module")
def reference(plain):
    return [o.outputs[0].token_ids for o in plain.chat(CHATS, GREEDY, use_tqdm=False)]


def _finished(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outputs]


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.long) if name == "draft_layers" else name
                                  for name in CONFIGS])
def test_greedy_output_is_identical_to_no_speculation(name, plain, reference):
    llm = LLM(**SETTINGS, speculative_config=CONFIGS[name])
    outputs = llm.chat(CHATS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = llm.llm_engine.get_stats().spec_decode
    assert stats.num_accepted_tokens > 0
    assert sum(o.metrics.spec_num_accepted_tokens for o in outputs) == stats.num_accepted_tokens
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks
    # Stop strings that match inside a verified step's tokens: the sequence ends at the token that
    # completes the string, with the same text and stop reason as plain decoding.
    text = plain.get_tokenizer().decode(reference[0])
    with_stop = SamplingParams(temperature=0.0, max_tokens=48, stop=[text[30:36], text[60:65]])
    ours, theirs = llm.chat(CHATS, with_stop, use_tqdm=False), plain.chat(CHATS, with_stop, use_tqdm=False)
    assert _finished(ours) == _finished(theirs)
    assert any(o.outputs[0].stop_reason in with_stop.stop for o in theirs)


def test_suffix_greedy_identical_under_batching_preemption_and_prefix_hits(plain, reference):
    """Two rounds of the same chats, four at a time in a KV pool too small for them all: the second round
    hits the prefix cache and finds the first round's outputs in the suffix cache, and every output
    equals plain decoding."""
    llm = LLM(**{**SETTINGS, "num_gpu_blocks_override": 12, "max_model_len": 160}, block_size=16, max_num_seqs=4,
              speculative_config={"method": "suffix"})
    engine = llm.llm_engine
    first = [o.outputs[0].token_ids for o in llm.chat(CHATS, GREEDY, use_tqdm=False)]
    assert engine.spec.suffix.cache.num_cached == len(CHATS)
    second = [o.outputs[0].token_ids for o in llm.chat(CHATS, GREEDY, use_tqdm=False)]
    assert first == second == reference
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode.num_accepted_tokens > 0
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("minivllm:spec_decode") and "position" not in sample.labels:
                values[sample.name.removesuffix("_total")] = sample.value
    return values


def test_server_streams_speculative_requests_with_right_usage(reference):
    engine = AsyncEngine(LLM(**SETTINGS, speculative_config={"method": "suffix"}).llm_engine)
    thread = ServerThread(build_app(engine))
    url = thread.start()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        before = _spec_counters(url)
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHATS[0], max_tokens=48,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHATS[0], max_tokens=48,
                                               temperature=0)
        assert text == plain.choices[0].message.content
        assert usage.completion_tokens == plain.usage.completion_tokens == len(reference[0])
        assert usage.prompt_tokens == plain.usage.prompt_tokens
        # Verified steps deliver several tokens at once: fewer content chunks than tokens.
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) < usage.completion_tokens
        after = _spec_counters(url)
        for name in ("minivllm:spec_decode_num_drafts", "minivllm:spec_decode_num_draft_tokens",
                     "minivllm:spec_decode_num_accepted_tokens"):
            assert after[name] > before.get(name, 0), name
    finally:
        thread.stop()
