"""GGUF Q4_0 / Q4_1 / Q8_0 linear weights kept quantized (quantization="gguf").

Our block unpacking is checked bit-for-bit against the `gguf` package's own dequantization; the CUDA
(code - zero) * scale form against it within fp32 rounding; and the real default model (Q4_1) loaded
kept-quantized against the dequantizing path: same greedy tokens, same logprobs, < 40% of the bytes.
"""
import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # the Triton GEMM on the kernel form, as test_quant_kernels does

import pytest  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.kernels.int4_gemm import weight_only_gemm  # noqa: E402
from minivllm.models.loader import default_model_path  # noqa: E402
from minivllm.quantization.gguf import (GGUF_TYPES, GGUFConfig, dequantize_gguf, held_tensors,  # noqa: E402
                                        kernel_form, quantized_weight_bytes, unpack_blocks)
from minivllm.quantization.packing import dequantize  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]


def _random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw GGUF rows: random codes, finite fp16 scales (and mins) of both signs, one all-flat block."""
    rng = np.random.default_rng(seed)
    _, _, has_min, nbytes = GGUF_TYPES[type_name]
    blocks = rng.integers(0, 256, size=(rows, cols // 32, nbytes), dtype=np.uint8)
    blocks[..., 0:2] = rng.normal(0, 0.01, size=(rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    if has_min:
        blocks[..., 2:4] = rng.normal(0, 0.05, size=(rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
        blocks[0, 0, 0:2] = 0          # d = 0: every value of the block is the min (codes 0, as ggml writes)
        blocks[0, 0, 4:] = 0
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(GGUF_TYPES))
@pytest.mark.parametrize("rows,cols", [(8, 32), (24, 96)])
def test_held_blocks_dequantize_exactly_as_gguf(type_name, rows, cols):
    raw = _random_blocks(type_name, rows, cols, seed=rows + cols)
    reference = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols)
    codes, scales, mins = unpack_blocks(raw, type_name, cols)
    held = held_tensors(codes, scales, mins, type_name)
    ours = dequantize_gguf(held["qweight"], held["scales"], held.get("mins"), type_name, cols)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(np.asarray(reference, dtype=np.float32)).t())


@pytest.mark.parametrize("type_name", sorted(GGUF_TYPES))
def test_kernel_form_matches_gguf(type_name):
    """The Triton GEMM's W = (code - zero) * scale form (Q4_1: zero = -m / d) equals gguf's values."""
    rows, cols = 16, 64
    raw = _random_blocks(type_name, rows, cols, seed=7)
    reference = torch.from_numpy(np.asarray(gguf_dequantize(raw, GGMLQuantizationType[type_name]),
                                            dtype=np.float32).reshape(rows, cols)).t()
    held = held_tensors(*unpack_blocks(raw, type_name, cols), type_name)
    config = GGUFConfig(type_name)
    scales, zeros = kernel_form(held["scales"], held.get("mins"), config.zero)
    ours = dequantize(held["qweight"], scales, zeros, 32, config.bits, cols)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    # the GEMM itself on that form (CUDA path of GGUFLinearMethod.apply; interpreter without a GPU)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(1))
    out = weight_only_gemm(x.to(device), held["qweight"].to(device), scales.to(device), zeros.to(device), 32,
                           config.bits)
    torch.testing.assert_close(out.cpu(), x @ reference, rtol=1e-4, atol=1e-5)


def test_unsupported_types_and_sources_are_refused():
    with pytest.raises(ValueError, match="Q6_K"):
        GGUFConfig("Q6_K")
    with pytest.raises(ValueError, match=".gguf"):
        LLM(model="tiny-llama", load_format="dummy", quantization="gguf")


@pytest.fixture(scope="module")
def both() -> tuple[LLM, LLM]:
    kwargs = dict(model=default_model_path(), dtype="float32", kv_cache_memory=16 * 2**20,
                  max_model_len=256, seed=0)
    return LLM(**kwargs), LLM(quantization="gguf", **kwargs)


def test_default_model_kept_quantized_matches_dequantized(both):
    dense, kept = both
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True)
    for ref, out in zip(dense.generate(PROMPTS, params), kept.generate(PROMPTS, params)):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for token in a:
                assert abs(a[token].logprob - b[token].logprob) < 1e-4


def test_default_model_linear_bytes_below_40_percent(both):
    dense, kept = both
    model = kept.llm_engine.runner.model
    assert model.quant_config.weight_type == "Q4_1"
    held, fp32 = quantized_weight_bytes(model)
    dense_linear = sum(p.numel() * p.element_size() for name, p in dense.llm_engine.runner.model.named_parameters()
                       if name.endswith("proj.weight"))
    assert fp32 == dense_linear   # every linear layer of the model is held quantized
    assert held < 0.4 * fp32
    assert held == fp32 * 0.625 / 4   # Q4_1: 20 bytes per block of 32 weights
    assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_model_kept_quantized_on_gpu():
    """The CUDA path (kernel form + Triton GEMM, tf32 dot) against the dequantized model in fp32 on the GPU:
    same first greedy token per prompt, its logprob within 0.05, and linear weights under 40% of fp32."""
    kwargs = dict(model=default_model_path(), dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=256, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    dense = [out.outputs[0] for out in LLM(**kwargs).generate(PROMPTS, params)]
    kept_llm = LLM(quantization="gguf", **kwargs)
    kept = [out.outputs[0] for out in kept_llm.generate(PROMPTS, params)]
    for a, b in zip(dense, kept):
        assert a.token_ids[0] == b.token_ids[0]
        token = a.token_ids[0]
        assert abs(a.logprobs[0][token].logprob - b.logprobs[0][token].logprob) < 0.05
    model = kept_llm.llm_engine.runner.model
    assert next(model.parameters()).is_cuda
    held, fp32 = quantized_weight_bytes(model)
    assert held < 0.4 * fp32
