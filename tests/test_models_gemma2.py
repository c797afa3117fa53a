"""Gemma-2 (and Gemma-3's additions) against transformers' Gemma2ForCausalLM (eager attention: sdpa ignores the soft cap). The tiny
checkpoint has a sliding window of 8 on layer 0 (shorter than every test context), attention and final
logit soft caps that bite, and an attention scale that is not head_dim ** -0.5; the fp32 logits agree
within 1e-4. "gemma2" is also one of conftest's NEW_FAMILY_ARCHS, so tests/test_models_families.py checks
the engine's greedy tokens under batching, chunked prefill and prefix-cache hits (CPU) and on CUDA
(Triton kernels with window and soft cap, CUDA graphs) against transformers, with contexts past the window."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import PagedRun, make_tiny_hf_checkpoint, tiny_hf_config
from tests.test_models_families import assert_logits_equal
from minivllm.models.loader import load_model, resolve_model
from minivllm.models.registry import applies_sliding_window, get_model_class

PROMPT_LENS = (13, 20, 5)
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma2")
    return folder, make_tiny_hf_checkpoint(folder, "gemma2")


def test_window_and_soft_caps_bite_in_the_reference(checkpoint):
    """Without this the other tests could pass with the options ignored."""
    _, reference = checkpoint
    ids = torch.arange(3, 3 + 24)[None]
    # Where transformers reads each option at run time (the attention cap is copied into the layers).
    holders = {"sliding_window": [reference.config], "final_logit_softcapping": [reference.config],
               "attn_logit_softcapping": [layer.self_attn for layer in reference.model.layers]}
    with torch.no_grad():
        logits = reference(ids).logits
        for option, objects in holders.items():
            saved = getattr(objects[0], option)
            for obj in objects:
                setattr(obj, option, 10 ** 6 if option == "sliding_window" else 1e6)   # as good as off
            try:
                assert (reference(ids).logits - logits).abs().max() > 1e-2, option
            finally:
                for obj in objects:
                    setattr(obj, option, saved)


def test_prefill_and_decode_logits_match_transformers(checkpoint):
    folder, reference = checkpoint
    model = load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(128, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    run = PagedRun(model, len(sequences), max(PROMPT_LENS) + DECODE_STEPS)
    with torch.no_grad():
        for seq, ours in zip(sequences, run.step(sequences)):
            assert_logits_equal(ours, reference(torch.tensor([seq])).logits[0])
        for _ in range(DECODE_STEPS):
            next_tokens = [[int(t)] for t in torch.randint(128, (len(sequences),), generator=generator)]
            for seq, token, ours in zip(sequences, next_tokens, run.step(next_tokens)):
                seq.extend(token)
                assert_logits_equal(ours[0], reference(torch.tensor([seq])).logits[0, -1])


def test_profiling_path_without_cache_matches_paged(checkpoint):
    """The empty-cache path (memory profiling) applies the window and caps too."""
    folder, _ = checkpoint
    model = load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"))
    sequences = [list(range(3, 23)), [17, 19, 5], list(range(40, 52))]
    paged = PagedRun(model, len(sequences), 24).step(sequences)
    no_cache = PagedRun(model, len(sequences), 24, use_kv_cache=False).step(sequences)
    for ours, expected in zip(no_cache, paged):
        assert_logits_equal(ours, expected)


def test_layer_options_follow_the_config():
    config = tiny_hf_config("gemma2")
    config.num_hidden_layers, config.layer_types = 4, None   # older configs: alternate, sliding first
    model_class = get_model_class(config)
    assert model_class.__name__ == "Gemma2ForCausalLM" and applies_sliding_window(config)
    with torch.device("meta"):
        model = model_class(config)
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [8, None, 8, None]
    assert {a.logits_soft_cap for a in attns} == {3.0} and {a.scale for a in attns} == {8 ** -0.5}
    assert not applies_sliding_window(tiny_hf_config("mistral"))


def test_gemma3_layers_use_their_own_rope_and_pattern():
    """Gemma-3: five sliding layers to one full one when the config has no `layer_types`; the sliding
    layers share the local RoPE table (`rope_local_base_freq`), the full ones the global, scaled one."""
    import transformers
    config = transformers.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           max_position_embeddings=256,
                                           sliding_window=8, rope_theta=1e6, rope_local_base_freq=100.0,
                                           rope_scaling={"rope_type": "linear", "factor": 8.0})
    model = get_model_class(config)(config)
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [8] * 5 + [None, 8]
    local, full = layers[0].self_attn.rotary_emb, layers[5].self_attn.rotary_emb
    assert all(layers[i].self_attn.rotary_emb is local for i in (1, 2, 3, 4, 6)) and full is not local
    assert layers[0].self_attn.q_norm is not None and layers[5].self_attn.k_norm is not None
    from minivllm.layers.rotary import get_rope
    assert torch.equal(local.cos_sin_cache, get_rope(16, 256, 100.0, None).cos_sin_cache)
    assert torch.equal(full.cos_sin_cache, get_rope(16, 256, 1e6, {"rope_type": "linear", "factor": 8.0}).cos_sin_cache)
