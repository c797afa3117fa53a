"""RMSNorm (and GPT-2's LayerNorm), with the residual add folded in (vLLM style) so a fused add+norm kernel can replace it.

Numerics follow HF Llama: normalise in fp32, cast back to the input dtype, then scale by the weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.rmsnorm import quantized_reference, rms_norm_reference
from minivllm.layers.fusion import fusions_enabled
from minivllm.layers.linear import default_weight_loader


def norm_layer_input(norm: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor | None):
    """A decoder layer's input norm: (normed input, residual stream). The first layer has no residual yet;
    later ones add the previous layer's output to it inside the norm (fused on CUDA)."""
    if residual is None:
        return norm(hidden_states), hidden_states
    return norm(hidden_states, residual)


class RMSNorm(nn.Module):
    can_quantize_output = True   # honours `quantize_output` (subclasses with their own forward say no)
    fusable_into_gemv = True     # layers/fusion.norms_in_gemvs: the int4 GEMV norms its x as forward does

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.use_triton = fusions_enabled()
        # Set by `fusion.fuse_input_quantization` when the only consumer is a W8A8 linear layer: the
        # normalised output then comes quantized per row (a QuantizedRows), in the same kernel.
        self.quantize_output: torch.dtype | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual) — the second
        value is the running residual stream the next layer adds its output to, written to `residual_out`
        where given (layers/fusion.PendingNorm's stream)."""
        if self.use_triton and x.is_cuda:
            from minivllm.kernels.rmsnorm import fused_add_rms_norm, rms_norm as triton_rms_norm
            if residual is None:
                return triton_rms_norm(x, self.weight, self.eps, self.quantize_output)
            return fused_add_rms_norm(x, residual, self.weight, self.eps, self.quantize_output, residual_out)
        if residual is None:
            return quantized_reference(rms_norm_reference(x, self.weight, self.eps), self.quantize_output)
        x = x + residual if residual_out is None else torch.add(x, residual, out=residual_out)
        return quantized_reference(rms_norm_reference(x, self.weight, self.eps), self.quantize_output), x


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (GPT-2), same residual convention as `RMSNorm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        out = F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return out if residual is None else (out, x)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: weights stored as an offset from one, `(1 + w)`, and applied in fp32 before the
    single rounding to the input dtype (Llama rounds first, then scales)."""
    can_quantize_output = False
    fusable_into_gemv = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        out = (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)
