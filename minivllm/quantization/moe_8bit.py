"""8-bit expert weights for FusedMoE (`quantization="fp8"` or `"int8"` on a plain checkpoint, or dummy weights
made in the format): each expert's rows stored as fp8 (e4m3) or int8 codes with one fp32 scale per output row,
as the dense W8A8 layers store theirs. The MoE kernels' grouped GEMMs run them as W8A8 (inputs quantized per
row, 8-bit tensor-core products); their few-token GEMVs widen each code against the activations as they are
(kernels/fused_moe.py). Either way a step streams half the bytes of every touched expert. Checkpoints that
store 8-bit experts are refused. Elsewhere than CUDA the reference computes with the dequantized weights.

Loaded weights are quantized expert by expert, so the transient fp32 copy stays one expert's size.
"""
from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels.quant_rows import FP8, quantize_rows_reference
from minivllm.quantization.base import replace_param

WEIGHTS = ("w13_weight", "w2_weight")


class Moe8BitMethod:
    def __init__(self, weight_dtype: torch.dtype, serialized: bool):
        self.dtype, self.serialized = weight_dtype, serialized

    def create_weights(self, layer: nn.Module) -> None:
        """Dummy weights in the format (serialized): the codes and scales directly, at one byte a weight."""
        if self.serialized:
            for name in WEIGHTS:
                param = getattr(layer, name)
                replace_param(layer, name, torch.empty(param.shape, dtype=self.dtype, device=param.device))
                layer.register_buffer(name.replace("weight", "scale"),
                                      torch.empty(param.shape[:2], dtype=torch.float32, device=param.device))

    @torch.no_grad()
    def init_dummy_weights(self, layer: nn.Module) -> None:
        """Codes spread over the 8-bit range, scales giving weights of std ~0.02 (as the dense layers')."""
        if not self.serialized:
            return
        for name in WEIGHTS:
            codes, scale = getattr(layer, name), getattr(layer, name.replace("weight", "scale"))
            if self.dtype == FP8:
                for expert in range(codes.shape[0]):
                    codes[expert].copy_(torch.randn(codes.shape[1:], device=codes.device).to(FP8))
                scale.fill_(0.02)
            else:
                codes.random_(-127, 128)
                scale.fill_(0.02 / 73)   # uniform int8 codes have std ~73

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.serialized:
            return
        for name in WEIGHTS:
            weight = getattr(layer, name).data
            codes = torch.empty(weight.shape, dtype=self.dtype, device=weight.device)
            scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
            for expert in range(weight.shape[0]):
                expert_codes, expert_scale = quantize_rows_reference(weight[expert], self.dtype)
                codes[expert].copy_(expert_codes)
                scale[expert].copy_(expert_scale.view(-1))
            replace_param(layer, name, codes)
            layer.register_buffer(name.replace("weight", "scale"), scale)
