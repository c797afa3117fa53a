"""The Llama-family model against transformers: tiny random checkpoints of every supported variant,
loaded through resolve_model + load_model, must give the same logits for a batched prefill and for
decode steps that read the paged KV cache."""
from __future__ import annotations

import pytest
import torch
import transformers

from tests.conftest import TINY_ARCHS, PagedRun, assert_logits_close, make_tiny_hf_checkpoint, tiny_hf_config
from minivllm.layers.rotary import get_rope, rope_parameters_of
from minivllm.models.loader import load_model, resolve_model
from minivllm.models.registry import get_model_class

PROMPT_LENS = (5, 9, 3)
DECODE_STEPS = 20  # as many decode steps as the acceptance asks of every architecture


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prefill_and_decode_match_transformers(arch, tmp_path):
    reference = make_tiny_hf_checkpoint(tmp_path, arch)
    source = resolve_model(str(tmp_path))
    model = load_model(source, torch.float32, torch.device("cpu"))
    vocab = source.hf_config.vocab_size
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(vocab, (n,), generator=generator).tolist() for n in PROMPT_LENS]

    run = PagedRun(model, len(sequences), max(PROMPT_LENS) + DECODE_STEPS)
    prefill_logits = run.step(sequences)
    with torch.no_grad():
        for seq, ours in zip(sequences, prefill_logits):
            assert_logits_close(ours, reference(torch.tensor([seq])).logits[0])

        for _ in range(DECODE_STEPS):
            next_tokens = [[int(t)] for t in torch.randint(vocab, (len(sequences),), generator=generator)]
            decode_logits = run.step(next_tokens)
            for seq, token, ours in zip(sequences, next_tokens, decode_logits):
                seq.extend(token)
                assert_logits_close(ours[0], reference(torch.tensor([seq])).logits[0, -1])


def test_attention_without_cache_matches_paged_prefill(tmp_path):
    """The memory-profiling path (empty KV cache) computes the same causal attention per sequence."""
    make_tiny_hf_checkpoint(tmp_path, "qwen3")
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    sequences = [[3, 5, 7, 11, 13], [17, 19], [23, 29, 31, 37]]
    paged = PagedRun(model, len(sequences), 8).step(sequences)
    no_cache = PagedRun(model, len(sequences), 8, use_kv_cache=False).step(sequences)
    for ours, reference in zip(no_cache, paged):
        assert_logits_close(ours, reference)


def test_tied_embeddings_share_one_tensor(tmp_path):
    make_tiny_hf_checkpoint(tmp_path, "llama-tied-bias")
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_rotary_frequencies_match_transformers(arch):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = tiny_hf_config(arch)
    theta, scaling = rope_parameters_of(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = get_rope(head_dim, 64, theta, scaling)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    else:
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    expected = torch.outer(torch.arange(64).float(), inv_freq)
    torch.testing.assert_close(rope.cos_sin_cache, torch.cat((expected.cos(), expected.sin()), -1))


def _checkpoint_weights(folder):
    from minivllm.models.loader import iterate_safetensors
    return dict(iterate_safetensors(str(folder)))


def test_load_weights_rejects_bad_checkpoints(tmp_path):
    make_tiny_hf_checkpoint(tmp_path, "qwen2")
    source = resolve_model(str(tmp_path))
    model = load_model(source, torch.float32, torch.device("cpu"), load_format="dummy")
    weights = _checkpoint_weights(tmp_path)

    with pytest.raises(ValueError, match="matches no model parameter"):
        model.load_weights([*weights.items(), ("model.layers.0.self_attn.z_proj.weight", torch.zeros(1))])
    bad_shape = dict(weights)
    bad_shape["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="shape mismatch"):
        model.load_weights(bad_shape.items())
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="lacks"):
        model.load_weights(missing.items())
    # inv_freq buffers of old checkpoints are ignored, not errors.
    model.load_weights([*weights.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])


def test_registry_maps_family_and_rejects_others():
    for arch in TINY_ARCHS:
        config = tiny_hf_config(arch)
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
        assert get_model_class(config).__name__ == "LlamaForCausalLM"
    other = transformers.BertConfig(architectures=["BertForMaskedLM"])
    with pytest.raises(ValueError, match="unsupported model architecture"):
        get_model_class(other)


def test_rope_parameters_read_from_both_transformers_config_styles():
    from types import SimpleNamespace
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    v4 = SimpleNamespace(rope_theta=500000.0, rope_scaling=dict(llama3))
    v5 = SimpleNamespace(rope_parameters={**llama3, "rope_theta": 500000.0})
    v4_plain = SimpleNamespace(rope_theta=1e6, rope_scaling=None)
    assert rope_parameters_of(v4) == rope_parameters_of(v5) == (500000.0, llama3)
    assert rope_parameters_of(v4_plain) == (1e6, {})
    with pytest.raises(ValueError, match="unsupported rope_type"):
        get_rope(16, 32, 10000.0, {"rope_type": "yarn", "factor": 4.0})
