"""Structured outputs under speculative decoding: the masks of a verified step's positions against matchers
advanced by hand; greedy constrained outputs with n-gram and draft-layers speculation token-identical to
no speculation (a tiny random Llama with the default tokenizer, and the real default model in fp32), with
drafts the grammar forbids and no leaked blocks; constrained sampling distributed as without speculation
(chi-square); a json_schema request streamed by the server."""
from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import numpy as np
import openai
import pytest
import transformers
import xgrammar as xgr

from minivllm import LLM, SamplingParams
from minivllm.core.interfaces import SchedulerOutput
from minivllm.core.sequence import SequenceGroup
from minivllm.engine.async_engine import AsyncEngine
from minivllm.models.loader import resolve_model
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.server.api_server import ServerThread, build_app
from minivllm.structured_output import StructuredOutputManager
from tests.conftest import make_tiny_hf_checkpoint
from tests.test_models_serving import write_byte_tokenizer
from tests.test_spec_decode import _chi_square_p_value
from tests.test_structured_output import SCHEMA as PERSON_SCHEMA

# test_structured_output's person without the address: short enough for few tokens on the CPU.
SCHEMA = {"type": "object", "required": ["name", "age", "pets", "color"],
          "properties": {k: v for k, v in PERSON_SCHEMA["properties"].items() if k != "address"}}
REGEX = r"[0-9]{3}-[0-9]{4}( [a-z]+){0,6}"
CHOICES = ["yes", "no", "yes indeed"]
# The first prompt asks to copy a JSON object (n-gram drafts from the prompt are accepted); the others
# invite drafts the grammar forbids (prose after a number, a choice among words of the prompt).
CHATS = [
    'Copy this JSON exactly: {"name": "Ann Lee", "age": 31, "pets": ["cat", "dog"], "color": "red"}',
    "Give the phone number 555-1234 and say it again: 555-1234, then explain why.",
    "Is the sky blue? Answer yes or no, and say yes twice.",
    "Describe a person as JSON.",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}


def _params(max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
            SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(regex=REGEX)),
            SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
            SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json_object=True))]


def _check_valid(texts: list[str], finish_reasons: list[str]) -> None:
    """Outputs that finished obey their grammar (a random model rarely finishes a JSON object)."""
    if finish_reasons[0] == "stop":
        jsonschema.validate(json.loads(texts[0]), SCHEMA)
    if finish_reasons[1] == "stop":
        assert re.fullmatch(REGEX, texts[1]), texts[1]
    assert texts[2] in CHOICES
    if finish_reasons[3] == "stop":
        assert isinstance(json.loads(texts[3]), dict)


def _run(llm: LLM, params: list[SamplingParams]):
    outputs = [o.outputs[0] for o in llm.chat([[{"role": "user", "content": c}] for c in CHATS], params,
                                              use_tqdm=False)]
    engine = llm.llm_engine
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    _check_valid([o.text for o in outputs], [o.finish_reason for o in outputs])
    return [o.token_ids for o in outputs]


# ---- the masks of a verified step --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    source = resolve_model(None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source.tokenizer_dir)
    return StructuredOutputManager(tokenizer, source.hf_config.vocab_size, {tokenizer.eos_token_id})


def test_verified_rows_are_masked_as_after_each_accepted_draft(manager):
    tokenizer = manager.tokenizer
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    manager.compile(params)
    group = SequenceGroup(request_id="0", prompt=None, prompt_token_ids=[1, 2, 3], sampling_params=params)
    seq = group.seqs[0]
    for token_id in tokenizer.encode('{"name": "Al'):
        seq.append_token(token_id)
    # Two tokens the grammar allows, then one it forbids (a digit inside a name), then one more.
    drafts = tokenizer.encode('ice Bo') + tokenizer.encode("7") + tokenizer.encode("b")
    seq.spec_token_ids = list(drafts)
    num_valid = len(tokenizer.encode("ice Bo"))
    manager.truncate_drafts([seq])
    assert seq.spec_token_ids == drafts[:num_valid]
    assert manager.num_rejected_draft_tokens == len(drafts) - num_valid

    for step_drafts, num_checked in ((drafts[:num_valid], num_valid + 1), (drafts, num_valid + 1)):
        output = SchedulerOutput(seqs=[seq], num_computed_tokens=[seq.num_tokens - 1],
                                 num_scheduled_tokens=[1 + len(step_drafts)], num_samples=[1],
                                 spec_token_ids=[step_drafts])
        bitmask = manager.grammar_bitmask(output)
        assert bitmask.shape == (len(step_drafts) + 1, manager.num_words)
        # The reference: a fresh matcher per row, fed the output and then the row's preceding drafts.
        for j in range(num_checked):
            matcher = xgr.GrammarMatcher(params.structured_outputs.compiled)
            for token_id in seq.output_token_ids + step_drafts[:j]:
                assert matcher.accept_token(token_id)
            expected = xgr.allocate_token_bitmask(1, manager.vocab_size).numpy()
            matcher.fill_next_token_bitmask(expected)
            assert np.array_equal(bitmask[j], expected[0]), j
        assert (bitmask[num_checked:] == -1).all()   # after a forbidden draft: never used
    # The drafts were rolled back: the next plain mask continues from the committed output.
    output = SchedulerOutput(seqs=[seq], num_computed_tokens=[seq.num_tokens - 1], num_scheduled_tokens=[1],
                             num_samples=[1])
    matcher = xgr.GrammarMatcher(params.structured_outputs.compiled)
    for token_id in seq.output_token_ids:
        matcher.accept_token(token_id)
    expected = xgr.allocate_token_bitmask(1, manager.vocab_size).numpy()
    matcher.fill_next_token_bitmask(expected)
    assert np.array_equal(manager.grammar_bitmask(output)[0], expected[0])


def test_verified_rows_after_the_grammar_completes_allow_stop_tokens_only(manager):
    """ignore_eos: the sequence goes on past the grammar's end; its drafts may be stop tokens only."""
    eos = manager.stop_token_ids[0]
    params = SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=["yes"]))
    manager.compile(params)
    seq = SequenceGroup(request_id="1", prompt=None, prompt_token_ids=[1, 2], sampling_params=params).seqs[0]
    for token_id in manager.tokenizer.encode("yes") + [eos]:
        seq.append_token(token_id)
    drafts = [eos, eos, manager.tokenizer.encode("no")[0]]
    output = SchedulerOutput(seqs=[seq], num_computed_tokens=[seq.num_tokens - 1], num_scheduled_tokens=[4],
                             num_samples=[1], spec_token_ids=[drafts])
    bitmask = manager.grammar_bitmask(output).view(np.uint32)
    only_eos = np.zeros(manager.num_words, dtype=np.uint32)
    only_eos[eos // 32] = 1 << (eos % 32)
    assert all(np.array_equal(bitmask[j], only_eos) for j in range(3))
    assert (bitmask[3] == np.uint32(0xFFFFFFFF)).all()   # after the forbidden "no": never used


# ---- the engine: greedy exactness ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama with the default model's vocabulary and tokenizer (grammars need one)."""
    folder = tmp_path_factory.mktemp("tiny-llama-tokenizer")
    default = resolve_model(None)
    make_tiny_hf_checkpoint(folder, "llama3", vocab_size=default.hf_config.vocab_size)
    transformers.AutoTokenizer.from_pretrained(default.tokenizer_dir).save_pretrained(str(folder))
    return str(folder)


@pytest.mark.parametrize("speculative_config", [
    NGRAM, {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 3, "adaptive": False}],
    ids=["ngram", "draft_layers"])
def test_tiny_model_constrained_greedy_is_token_identical(tiny_model, speculative_config):
    settings = dict(dtype="float32", kv_cache_memory=16 << 20, max_model_len=256, seed=0, block_size=4)
    reference = _run(LLM(tiny_model, **settings), _params(24))
    llm = LLM(tiny_model, **settings, speculative_config=speculative_config, async_scheduling=True)
    assert _run(llm, _params(24)) == reference
    engine = llm.llm_engine
    assert engine.get_stats().spec_decode.num_draft_tokens > 0
    assert engine.structured_output.num_rejected_draft_tokens > 0


# ---- the engine: sampling distribution ---------------------------------------------------------------------

SAMPLING_ENGINE = dict(dtype="float32", kv_cache_memory=16 << 20, max_model_len=64, seed=0, max_num_seqs=256,
                       max_num_batched_tokens=2048)


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory) -> str:
    """A tiny random Llama with a one-token-per-byte tokenizer (257 tokens: sampling 8k rows stays cheap)."""
    folder = tmp_path_factory.mktemp("tiny-llama-bytes")
    vocab = write_byte_tokenizer(folder)
    make_tiny_hf_checkpoint(folder, "llama3", vocab_size=vocab, eos_token_id=vocab - 1)
    return str(folder)


def _sample_constrained(llm: LLM, num_samples: int) -> list[Counter]:
    """Histograms of output positions 1 and 2 (those verified steps produce) under a regex, at temperature 1."""
    params = SamplingParams(temperature=1.0, max_tokens=3, n=64,
                            structured_outputs=StructuredOutputsParams(regex="[a-h]{5}"))
    outputs = llm.generate(["abcdefghabcdefghabc"] * (num_samples // 64), params, use_tqdm=False)
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks
    assert all(re.fullmatch("[a-h]{3}", c.text) for o in outputs for c in o.outputs)
    tokens = [c.token_ids for o in outputs for c in o.outputs]
    return [Counter(t[j] for t in tokens) for j in (1, 2)]


@pytest.fixture(scope="module")
def constrained_distribution(byte_model) -> list[Counter]:
    return _sample_constrained(LLM(byte_model, **SAMPLING_ENGINE), 8192)


@pytest.mark.parametrize("speculative_config", [
    NGRAM, {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 3, "adaptive": False}],
    ids=["ngram", "draft_layers"])
def test_constrained_sampling_has_the_non_speculative_distribution(byte_model, constrained_distribution,
                                                                   speculative_config):
    """8,192 samples under a regex at temperature 1: the speculated positions are distributed as without
    speculation (two-sample chi-square). N-gram drafts (letters of the prompt) are allowed and accepted
    or not by p/q; the one-layer draft mostly proposes bytes the grammar forbids (p = 0: rejected)."""
    llm = LLM(byte_model, **SAMPLING_ENGINE, speculative_config=speculative_config)
    speculative = _sample_constrained(llm, 8192)
    stats = llm.llm_engine.get_stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if speculative_config is not NGRAM:
        assert llm.llm_engine.structured_output.num_rejected_draft_tokens > 0
    p_values = [_chi_square_p_value(a, b) for a, b in zip(speculative, constrained_distribution)]
    print(f"acceptance {stats.num_accepted_tokens}/{stats.num_draft_tokens}, forbidden drafts "
          f"{llm.llm_engine.structured_output.num_rejected_draft_tokens}, chi-square p-values {p_values}")
    assert min(p_values) > 1e-3, p_values


# ---- the real default model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_reference():
    return _run(LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024, seed=0), _params(32))


@pytest.mark.parametrize("speculative_config", [
    NGRAM, {"method": "draft_model", "draft_layers": 24, "num_speculative_tokens": 2, "adaptive": False}],
    ids=["ngram", "draft_layers"])
def test_real_model_constrained_greedy_is_token_identical(real_reference, speculative_config):
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024, seed=0,
              speculative_config=speculative_config)
    assert _run(llm, _params(32)) == real_reference
    engine = llm.llm_engine
    stats = engine.get_stats().spec_decode
    assert stats.num_accepted_tokens > 0
    assert engine.structured_output.num_rejected_draft_tokens > 0


def test_server_streams_a_speculative_json_schema_request(real_reference):
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024, seed=0, speculative_config=NGRAM)
    thread = ServerThread(build_app(AsyncEngine(llm.llm_engine)))
    url = thread.start()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        stream = client.chat.completions.create(
            model="", messages=[{"role": "user", "content": CHATS[0]}], max_tokens=32, temperature=0,
            response_format=response_format, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
    finally:
        thread.stop()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == llm.get_tokenizer().decode(real_reference[0], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].usage.completion_tokens == len(real_reference[0])
    # Verified steps deliver several tokens at once: fewer content chunks than tokens.
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) < len(real_reference[0])
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks
