"""Serving tiny GPT-2, MoE and Gemma-2 folders (random weights, byte-level tokenizer written by the test)
through the OpenAI-compatible server, called with the official `openai` SDK: the greedy answers equal the
offline `LLM` API's for the same engine."""
from __future__ import annotations

import openai
import pytest

from tests.conftest import make_tiny_hf_checkpoint
from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.server.api_server import ServerThread, build_app

PROMPT = "Hello, tiny model"
MAX_TOKENS = 6


def write_byte_tokenizer(folder) -> int:
    """A byte-level BPE tokenizer without merges (one token per byte) plus an end-of-text token and
    a minimal chat template; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(str(folder))
    return len(vocab)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3-moe", "gemma2"])
def test_serve_tiny_folder_with_openai_sdk(arch, tmp_path):
    vocab = write_byte_tokenizer(tmp_path)
    make_tiny_hf_checkpoint(tmp_path, arch, vocab_size=vocab, eos_token_id=vocab - 1)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=4 << 20, max_model_len=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    offline = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    chat_offline = llm.chat([{"role": "user", "content": "Hi"}], greedy, use_tqdm=False)[0].outputs[0]

    thread = ServerThread(build_app(AsyncEngine(llm.llm_engine)))
    url = thread.start()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        [model] = [m.id for m in client.models.list().data]
        completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                               temperature=0.0)
        assert completion.choices[0].text == offline.text
        assert completion.usage.completion_tokens == len(offline.token_ids) > 0
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=MAX_TOKENS, temperature=0.0)
        assert chat.choices[0].message.content == chat_offline.text
    finally:
        thread.stop()
