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
                                          (33, 136, 40, W8A8Tile(32, 16, 32, 4, 2, 2)),
                                          (5, 200, 72, W8A8Tile(16, 32, 64, 4, 2, 3, True)),
                                          (33, 136, 40, W8A8Tile(32, 16, 32, 4, 2, 2, True))])
def test_w8a8_triton_kernel_matches_reference(dtype, M, K, N, config):
    """The split-K Triton GEMM (interpreter on CPU) on odd shapes: ragged K tiles and splits, N and M tails;
    the partials summed by a second kernel or by each tile's last slice (twice: the tickets reset)."""
    generator = torch.Generator().manual_seed(M)
    x_codes, x_scale = quantize_rows(torch.randn(M, K, generator=generator), dtype)
    w_codes, w_scale = quantize_rows(torch.randn(N, K, generator=generator) * 0.02, dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = [t.to(device) for t in (x_codes, x_scale, w_codes, w_scale.view(-1))]
    ours = w8a8_triton(*args, torch.float32, config)
    reference = w8a8_reference(x_codes, x_scale, w_codes, w_scale.view(-1), torch.float32)
    torch.testing.assert_close(ours.cpu(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    assert torch.equal(w8a8_triton(*args, torch.float32, config), ours)


def _fused_input_cases():
    from minivllm.kernels.activation import silu_and_mul
    from minivllm.kernels.rmsnorm import fused_add_rms_norm, rms_norm
    weight = torch.rand(96) + 0.5
    return {"rms_norm": (lambda x, q: rms_norm(x, weight.to(x.device, x.dtype), 1e-6, q), 96),
            "fused_add_rms_norm": (lambda x, q: fused_add_rms_norm(x, x.flip(0), weight.to(x.device, x.dtype),
                                                                   1e-6, q), 96),
            "silu_and_mul": (lambda x, q: silu_and_mul(x, q), 2 * 80)}


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("dtype", [FP8, torch.int8])
@pytest.mark.parametrize("rows", [3, 17])   # silu_and_mul fuses the quantization from 16 rows on
def test_producer_kernels_quantize_as_quantize_rows(name, dtype, rows):
    """A norm or activation asked for W8A8 input (`quant_dtype`) returns exactly the codes and scales that
    quantizing its 16-bit output would give; the residual stream is unchanged (interpreted on CPU)."""
    from minivllm.kernels.quant_rows import QuantizedRows, quantize_rows_triton
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fn, width = _fused_input_cases()[name]
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(1)) * 3).to(torch.float16).to(device)
    x[2, 7] = 40.0   # an outlier channel sets one row's scale
    plain, fused = fn(x, None), fn(x, dtype)
    if name == "fused_add_rms_norm":
        (plain, plain_residual), (fused, fused_residual) = plain, fused
        assert torch.equal(plain_residual, fused_residual)
    assert isinstance(fused, QuantizedRows) and fused.shape == plain.shape and fused.dtype == plain.dtype
    codes, scales = quantize_rows_triton(plain.reshape(-1, plain.shape[-1]), dtype)
    assert torch.equal(fused.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(fused.scales, scales)


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_fused_input_quantization_pairs_and_logits(method, tmp_path):
    """Loading a W8A8 model hands each layer's qkv_proj, gate_up_proj and down_proj their input already
    quantized by the norm / activation in front of them, and the logits equal those of the same model
    quantizing inside each linear layer."""
    from minivllm.layers.fusion import fuse_input_quantization
    make_tiny_hf_checkpoint(tmp_path, "llama3")
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), quantization=method)
    producers = [m for m in model.modules() if getattr(m, "quantize_output", None) is not None]
    assert len(producers) == 3 * len(model.model.layers)
    assert model.model.norm.quantize_output is None    # feeds the unquantized lm_head
    with torch.no_grad():
        fused = PagedRun(model, len(SEQUENCES), 8).step(SEQUENCES)
        for m in producers:
            m.quantize_output = None
        plain = PagedRun(model, len(SEQUENCES), 8).step(SEQUENCES)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    assert fuse_input_quantization(model) == len(producers)
    unquantized = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    assert fuse_input_quantization(unquantized) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize("dtype", [FP8, torch.int8])
def test_gpu_producer_kernels_quantize_as_quantize_rows(rows, dtype):
    """Against quant_rows on the plain kernels' 16-bit output, over many rows and seeds: the fused norm's own
    16-bit row (never stored) may differ from the plain kernel's by one bf16 step in about 1 value in 10^6
    (another summation order of the variance), so a code may be one grid step off there, nowhere else."""
    from minivllm.kernels.activation import silu_and_mul
    from minivllm.kernels.rmsnorm import fused_add_rms_norm

    def check(fused, plain):
        codes, scales = quantize_rows(plain, dtype)
        assert torch.equal(fused.scales, scales)
        ours, theirs = fused.codes.float(), codes.float()
        off = ours != theirs
        assert off.float().mean().item() < 1e-4
        step = 1.0 if dtype == torch.int8 else theirs.abs() / 8 + 2.0 ** -9   # one e4m3 step at that binade
        assert ((ours - theirs).abs() <= step)[off].all()
        return int(off.sum())

    generator = torch.Generator(device="cuda").manual_seed(rows)
    total_off = 0
    for _ in range(8):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=generator)
        residual = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=generator)
        weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16, generator=generator) + 0.5
        (plain, _), (fused, _) = fused_add_rms_norm(x, residual, weight, 1e-5), \
            fused_add_rms_norm(x, residual, weight, 1e-5, dtype)
        total_off += check(fused, plain)
        gate_up = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16, generator=generator)
        total_off += check(silu_and_mul(gate_up, dtype), silu_and_mul(gate_up))
    assert total_off <= 1e-5 * 8 * rows * (4096 + 14336)
