"""8-bit experts (quantization/moe_8bit.py): `quantization="fp8"` / `"int8"` on an unquantized MoE checkpoint
stores each expert row as codes with a row scale, quantized expert by expert while loading, and the model's
experts then compute with the dequantized weights; dummy weights are made in the format directly."""
from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.kernels.fused_moe import fused_experts_reference
from minivllm.kernels.quant_rows import quantize_rows_reference
from minivllm.layers.fused_moe import FusedMoE
from minivllm.quantization import get_quantization_config, quantization_context
from tests.conftest import make_tiny_hf_checkpoint, tiny_hf_config


def _loaded_layer(config, w13, w2):
    with quantization_context(config):
        layer = FusedMoE(w13.shape[0], 2, w13.shape[2], w2.shape[2], renormalize=True)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        layer.weight_loader(layer.w13_weight, w13[e, :inter], (e, "w1"))
        layer.weight_loader(layer.w13_weight, w13[e, inter:], (e, "w3"))
        layer.weight_loader(layer.w2_weight, w2[e], (e, "w2"))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("method, code_dtype", [("fp8", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_experts_are_quantized_per_row_at_load_and_compute_with_the_dequantized_weights(method, code_dtype):
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 2 * 24, 32, generator=g) / 6, torch.randn(4, 32, 24, generator=g) / 5
    layer = _loaded_layer(get_quantization_config(tiny_hf_config("qwen3-moe"), method), w13, w2)
    assert layer.w13_weight.dtype == layer.w2_weight.dtype == code_dtype
    assert layer.w13_scale.shape == (4, 48) and layer.w2_scale.shape == (4, 32)
    for weight, codes, scale in ((w13, layer.w13_weight, layer.w13_scale), (w2, layer.w2_weight, layer.w2_scale)):
        expected_codes, expected_scale = quantize_rows_reference(weight.reshape(-1, weight.shape[-1]), code_dtype)
        assert torch.equal(codes.reshape(-1, weight.shape[-1]).float(), expected_codes.float())
        assert torch.equal(scale.reshape(-1), expected_scale.reshape(-1))
    x, logits = torch.randn(5, 32, generator=g), torch.randn(5, 4, generator=g)
    out = layer(x, logits)
    weights, ids = torch.topk(torch.softmax(logits, -1), 2)
    dequantized = fused_experts_reference(x, layer.w13_weight.float() * layer.w13_scale[..., None],
                                          layer.w2_weight.float() * layer.w2_scale[..., None],
                                          weights / weights.sum(-1, keepdim=True), ids)
    torch.testing.assert_close(out, dequantized, rtol=1e-5, atol=1e-6)
    exact = fused_experts_reference(x, w13, w2, weights / weights.sum(-1, keepdim=True), ids)
    assert 0 < (out - exact).abs().max() < 0.05 * exact.abs().max()   # 8-bit rounding, not a different layer


def test_an_moe_model_runs_with_fp8_experts_close_to_bf16_ones(tmp_path):
    """A tiny Qwen3-MoE checkpoint with quantization="fp8": experts in fp8, and the first greedy tokens
    as with the checkpoint's own weights (one dense layer and one sparse; the dense layers are fp8 W8A8)."""
    make_tiny_hf_checkpoint(tmp_path, "qwen3-moe")
    options = dict(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=128,
                   kv_cache_memory=4 << 20)
    prompts = [{"prompt_token_ids": list(range(3, 20))}, {"prompt_token_ids": list(range(40, 47))}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(**options).generate(prompts, params, use_tqdm=False)]
    llm = LLM(quantization="fp8", **options)
    experts = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.w13_weight.dtype == torch.float8_e4m3fn for m in experts)
    # the router stays in the model's dtype (Mixtral's 8-expert gate has too few rows for an fp8 GEMM anyway)
    gates = [m.gate for m in llm.llm_engine.runner.model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    assert gates and all(g.weight.dtype == torch.float32 for g in gates)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [t[0] for t in ours] == [t[0] for t in plain]


def test_dummy_weights_are_made_in_the_format():
    config = get_quantization_config(tiny_hf_config("qwen3-moe"), "fp8", "dummy")
    with quantization_context(config):
        layer = FusedMoE(4, 2, 32, 24, renormalize=True)
    assert layer.w13_weight.dtype == torch.float8_e4m3fn and layer.w2_scale.dtype == torch.float32
    layer.quant_method.init_dummy_weights(layer)
    assert float(layer.w13_scale.min()) == pytest.approx(0.02)
    out = layer(torch.randn(3, 32), torch.randn(3, 4))
    assert torch.isfinite(out).all() and out.abs().max() > 0
