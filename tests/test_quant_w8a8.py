"""fp8 and int8 W8A8: online quantization of a plain checkpoint at load, a serialized fp8 checkpoint
(per-tensor scales per q/k/v shard, as AutoFP8 / llm-compressor write), and the CUDA GEMMs against the
CPU reference (`gpu`)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import PagedRun, make_tiny_hf_checkpoint
from minivllm.models.loader import load_model, resolve_model
from minivllm.kernels.w8a8_gemm import W8A8Tile, w8a8_gemm, w8a8_library, w8a8_triton
from minivllm.quantization.w8a8 import FP8, quantize_rows, w8a8_reference

SEQUENCES = [[3, 5, 7, 11, 13, 17], [19, 23, 29]]


def logits_error(model, reference) -> float:
    """Max |ours - transformers| relative to the largest logit."""
    worst = 0.0
    with torch.no_grad():
        for seq, ours in zip(SEQUENCES, PagedRun(model, len(SEQUENCES), 8).step(SEQUENCES)):
            expected = reference(torch.tensor([seq])).logits[0]
            worst = max(worst, ((ours - expected).abs().max() / expected.abs().max()).item())
    return worst


@pytest.mark.parametrize("method,bound", [("fp8", 0.15), ("int8", 0.05)])
def test_online_quantization_keeps_weights_within_a_step(method, bound, tmp_path):
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3")
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), quantization=method)
    down = model.model.layers[1].mlp.down_proj
    original = reference.model.layers[1].mlp.down_proj.weight
    assert down.weight.dtype == (FP8 if method == "fp8" else torch.int8)
    dequantized = down.weight.float() * down.weight_scale.view(-1, 1)
    if method == "int8":   # a uniform grid: half a step per channel
        step = down.weight_scale.view(-1, 1)
        assert ((dequantized - original).abs() <= step / 2 + 1e-7).all()
    else:                  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus the subnormal range
        tiny = down.weight_scale.view(-1, 1) * 2.0 ** -9
        assert ((dequantized - original).abs() <= original.abs() / 16 + tiny).all()
    assert logits_error(model, reference) < bound


def test_serialized_fp8_checkpoint_loads_per_shard_scales(tmp_path):
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3")
    tensors, expected = {}, {}
    for name, tensor in reference.state_dict().items():
        if name.endswith("proj.weight"):
            scale = tensor.abs().max() / 448.0   # one scale per checkpoint tensor
            codes = (tensor / scale).to(FP8)
            tensors[name], tensors[name.replace("weight", "weight_scale")] = codes, scale.reshape(())
            tensors[name.replace("weight", "input_scale")] = torch.tensor(1.0)
            expected[name] = codes.float() * scale
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (tmp_path / "config.json").write_text(json.dumps(config))

    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    ours = qkv.weight.float() * qkv.weight_scale.view(-1, 1)
    stacked = torch.cat([expected[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(ours, stacked, rtol=0, atol=0)
    with torch.no_grad():
        for name, weight in expected.items():
            reference.get_parameter(name).copy_(weight)
    assert logits_error(model, reference) < 0.15   # activations are rounded to fp8 too


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [FP8, torch.int8])
@pytest.mark.parametrize("M", [1, 16, 64, 300])
def test_w8a8_cuda_matches_reference(dtype, M):
    """The tuned dispatch, the library GEMM and every Triton candidate, on the 8B qkv shape."""
    from minivllm.kernels.w8a8_gemm import candidates
    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    x_codes, x_scale = quantize_rows(x, dtype)
    w_codes, w_scale = quantize_rows(w, dtype)
    args = (x_codes, x_scale, w_codes, w_scale.view(-1), torch.bfloat16)
    reference = w8a8_reference(*args[:4], torch.float32)
    results = [w8a8_gemm(*args), w8a8_library(*args)]
    if M <= 64:
        results += [w8a8_triton(*args, c) for c in candidates(M, 6144, 4096, x.device) if c is not None]
    for ours in results:
        torch.testing.assert_close(ours.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


@pytest.mark.parametrize("dtype", [FP8, torch.int8])
@pytest.mark.parametrize("M,K,N,config", [(1, 200, 72, W8A8Tile(16, 32, 64, 4, 2, 1)),
                                          (5, 200, 72, W8A8Tile(16, 32, 64, 4, 2, 3)),
                                          (33, 136, 40, W8A8Tile(32, 16, 32, 4, 2, 2))])
def test_w8a8_triton_kernel_matches_reference(dtype, M, K, N, config):
    """The split-K Triton GEMM (interpreter on CPU) on odd shapes: ragged K tiles and splits, N and M tails."""
    generator = torch.Generator().manual_seed(M)
    x_codes, x_scale = quantize_rows(torch.randn(M, K, generator=generator), dtype)
    w_codes, w_scale = quantize_rows(torch.randn(N, K, generator=generator) * 0.02, dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = [t.to(device) for t in (x_codes, x_scale, w_codes, w_scale.view(-1))]
    ours = w8a8_triton(*args, torch.float32, config)
    reference = w8a8_reference(x_codes, x_scale, w_codes, w_scale.view(-1), torch.float32)
    torch.testing.assert_close(ours.cpu(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
