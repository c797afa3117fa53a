"""Activations for gated MLPs. The input holds both halves side by side, as `gate_up_proj` produces them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.activation import silu_and_mul_reference
from minivllm.kernels.rmsnorm import quantized_reference
from minivllm.layers.fusion import fusions_enabled


class SiluAndMul(nn.Module):
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:] (SwiGLU)."""
    can_quantize_output = True   # see RMSNorm
    fusable_into_gate_up = True  # layers/fusion.gate_up_activation

    def __init__(self) -> None:
        super().__init__()
        self.use_triton = fusions_enabled()
        self.quantize_output: torch.dtype | None = None   # as RMSNorm's (fusion.fuse_input_quantization)

    def forward(self, x: torch.Tensor):
        if self.use_triton and x.is_cuda:
            from minivllm.kernels.activation import silu_and_mul as triton_silu_and_mul
            return triton_silu_and_mul(x, self.quantize_output)
        return quantized_reference(silu_and_mul_reference(x), self.quantize_output)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeluAndMul(nn.Module):
    """x [..., 2d] -> gelu_tanh(x[..., :d]) * x[..., d:] (GeGLU, Gemma's `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)


class NewGELU(nn.Module):
    """GPT-2's `gelu_new`: the tanh approximation of GELU (no gating)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")
