"""GGUF Q4_0 / Q4_1 / Q8_0 linear weights kept quantized (`quantization="gguf"` on a .gguf file).

ggml stores each weight row in blocks of 32 consecutive inputs: an fp16 scale d, for Q4_1 an fp16
min m, then the codes (Q4: 16 bytes, value j in the low nibble of byte j and value j + 16 in the high
nibble; Q8_0: 32 int8). Dequantized: Q4_0 w = d * (q - 8), Q4_1 w = d * q + m, Q8_0 w = d * q.
We hold the codes in our weight-only layout (packing.py: qweight [K / pf, N] int32, unsigned codes,
groups of 32 inputs) with the block's own fp16 `scales` [G, N] (and `mins` [G, N] for Q4_1), so
  W[k, n] = (code[k, n] - ZERO) * scale[g, n] (+ min[g, n]),  ZERO = 8 (Q4_0), 0 (Q4_1), 128 (Q8_0),
which in fp32 is bit-identical to gguf's own dequantization. 0.5625 / 0.625 / 1.0625 bytes per weight
instead of 4 (fp32) or 2 (bf16). On CUDA the layer is converted once to the Triton GEMM's
(code - zero) * scale form (Q4_1: zero = -m / d). Only linear layers: embeddings, norms and the LM
head are dequantized by the GGUF converter (models/gguf_loader.py).
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from minivllm.quantization.base import QuantizationConfig, add_param, shard_loader
from minivllm.quantization.packing import pack_factor, pack_rows, unpack_rows

BLOCK = 32
# type name -> (bits, zero point of the unsigned codes, has a min, bytes per block)
GGUF_TYPES = {"Q4_0": (4, 8, False, 18), "Q4_1": (4, 0, True, 20), "Q8_0": (8, 128, False, 34)}


def unpack_blocks(raw: np.ndarray, type_name: str, cols: int):
    """Raw block bytes uint8 [N, cols / 32 * block bytes] -> (codes uint8 [N, cols] unsigned,
    scales fp16 [N, G], mins fp16 [N, G] or None)."""
    bits, _, has_min, nbytes = GGUF_TYPES[type_name]
    if cols % BLOCK:
        raise ValueError(f"GGUF {type_name} rows of {cols} values are not whole blocks of {BLOCK}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(raw.shape[0], cols // BLOCK, nbytes)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if has_min else None
    qs = blocks[..., 4 if has_min else 2:]
    if bits == 4:
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)          # values 0..15, then 16..31
    else:
        codes = (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes.reshape(raw.shape[0], cols), scales, mins


def dequantize_gguf(qweight, scales, mins, type_name: str, in_features: int) -> torch.Tensor:
    """W [K, N] in fp32 from our held form (the reference `apply` multiplies with)."""
    bits, zero, _, _ = GGUF_TYPES[type_name]
    codes = unpack_rows(qweight, bits, in_features).float() - zero
    group = torch.arange(in_features, device=qweight.device) // BLOCK
    w = codes * scales.float()[group]
    return w if mins is None else w + mins.float()[group]


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, weight_type: str):
        if weight_type not in GGUF_TYPES:
            raise ValueError(f"quantization='gguf' keeps {sorted(GGUF_TYPES)} linear weights quantized, "
                             f"not {weight_type}; load without quantization to dequantize")
        self.weight_type = weight_type
        self.bits, self.zero, self.has_min, _ = GGUF_TYPES[weight_type]

    @classmethod
    def from_config(cls, config: dict) -> "GGUFConfig":
        if "weight_type" not in config:
            raise ValueError("quantization='gguf' needs a .gguf model file (its linear weights' block type)")
        return cls(config["weight_type"])

    def describe(self) -> str:
        return f"gguf ({self.weight_type}, kept quantized)"

    def get_quant_method(self, layer: nn.Module):
        return GGUFLinearMethod(self)


class GGUFLinearMethod:
    def __init__(self, config: GGUFConfig):
        self.config = config

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        bits = self.config.bits
        if input_size % BLOCK:
            raise ValueError(f"GGUF blocks need layer inputs divisible by {BLOCK}, got {input_size}")
        groups = input_size // BLOCK
        pf = pack_factor(bits)
        add_param(layer, "qweight", (input_size // pf, output_size), torch.int32, shard_loader(layer, 1, 1, 0, pf))
        add_param(layer, "scales", (groups, output_size), torch.float16, shard_loader(layer, 1, 1, 0, BLOCK, "group"))
        if self.config.has_min:
            add_param(layer, "mins", (groups, output_size), torch.float16, shard_loader(layer, 1, 1, 0, BLOCK, "group"))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.qweight.is_cuda:
            return
        scales, zeros = kernel_form(layer.scales.data, getattr(layer, "mins", None), self.config.zero)
        if self.config.has_min:
            del layer.mins
            zeros = zeros.float()    # -m / d needs more than fp16's precision
        layer.scales = nn.Parameter(scales, requires_grad=False)
        layer.zeros = nn.Parameter(zeros, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.is_cuda:
            from minivllm.kernels.int4_gemm import weight_only_gemm
            out = weight_only_gemm(x, layer.qweight, layer.scales, layer.zeros, BLOCK, self.config.bits)
        else:   # weights formed in fp32 (exactly gguf's values), then the product in x's dtype
            w = dequantize_gguf(layer.qweight, layer.scales, getattr(layer, "mins", None),
                                self.config.weight_type, layer.input_size)
            out = x @ w.to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])


def kernel_form(scales: torch.Tensor, mins: torch.Tensor | None, zero: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales fp16, zeros) with W = (code - zero) * scale, the Triton GEMM's form. Q4_1: zero = -m / d;
    a block with d = 0 holds only codes 0 (all values m), which scale 1, zero -m reproduces."""
    if mins is None:
        return scales, torch.full_like(scales, float(zero))
    d, m = scales.float(), mins.float()
    flat = d == 0
    return torch.where(flat, 1.0, d).half(), torch.where(flat, -m, -m / torch.where(flat, 1.0, d))


def held_tensors(codes: np.ndarray, scales: np.ndarray, mins, type_name: str) -> dict[str, torch.Tensor]:
    """Our layout from `unpack_blocks`' [N, ...] arrays (rows already in HF order)."""
    bits = GGUF_TYPES[type_name][0]
    held = {"qweight": pack_rows(torch.from_numpy(codes).t().to(torch.int32), bits),
            "scales": torch.from_numpy(np.ascontiguousarray(scales.T))}
    if mins is not None:
        held["mins"] = torch.from_numpy(np.ascontiguousarray(mins.T))
    return held


def quantized_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the GGUF-held linear layers occupy, bytes their weights would take in fp32)."""
    held = dense = 0
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), GGUFLinearMethod):
            held += sum(p.numel() * p.element_size() for n, p in module.named_parameters(recurse=False) if n != "bias")
            dense += module.input_size * module.output_size * 4
    return held, dense



def log_weight_bytes(model: nn.Module, config: GGUFConfig) -> None:
    held, dense = quantized_weight_bytes(model)
    logging.getLogger(__name__).info("%s: linear weights %.1f MiB resident (%.1f MiB in fp32, %.1f%%)",
                                     config.describe(), held / 2**20, dense / 2**20, 100 * held / max(dense, 1))
