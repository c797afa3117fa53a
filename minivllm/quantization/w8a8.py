"""8-bit weights and activations (W8A8), shared by fp8 and int8: per-output-channel weight scales,
dynamic per-token activation scales computed in each forward.

y[m, n] = sum_k xq[m, k] wq[n, k] * sx[m] * sw[n], with xq = quant(x / sx), sx = max|x[m]| / QMAX.
On CUDA the activations are quantized by one Triton kernel (kernels/quant_rows.py) and the 8-bit product
runs on the tensor cores (kernels/w8a8_gemm.py: a split-K Triton GEMM at decode sizes, torch._scaled_mm /
torch._int_mm above); elsewhere `w8a8_reference` emulates it: the same 8-bit values (fp8 rounding through
real torch.float8_e4m3fn casts), products summed in fp32.
"""
from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels.quant_rows import (FP8, FP8_MAX, INT8_MAX, QuantizedRows, quantize_rows,  # noqa: F401
                                         quantize_rows_reference)
from minivllm.kernels.w8a8_gemm import w8a8_gemm, w8a8_reference
from minivllm.quantization.base import QuantizationConfig, add_param, replace_param, shard_loader


class W8A8Config(QuantizationConfig):
    weight_dtype: torch.dtype = FP8

    def __init__(self, serialized: bool):
        self.serialized = serialized   # the checkpoint holds 8-bit weights (else: quantize at load)
        self.dummy = False             # random weights made directly in the format (benchmarks)

    @classmethod
    def for_dummy(cls) -> "W8A8Config":
        config = super().for_dummy()
        config.dummy = True
        return config

    @classmethod
    def from_config(cls, config: dict) -> "W8A8Config":
        return cls(serialized=bool(config.get("serialized", True)))

    def describe(self) -> str:
        return f"{self.name} (w8a8, {'serialized' if self.serialized else 'quantized at load'})"

    def get_quant_method(self, layer: nn.Module):
        return W8A8LinearMethod(self)

    def get_moe_method(self, layer: nn.Module):
        """8-bit experts when quantizing at load or making dummy weights; a checkpoint's own experts load as
        stored (in the model's dtype; 8-bit experts in a checkpoint are refused by the MoE models' loader)."""
        if self.serialized and not self.dummy:
            return None
        from minivllm.quantization.moe_8bit import Moe8BitMethod
        return Moe8BitMethod(self.weight_dtype, self.serialized)


def _scale_loader(layer: nn.Module):
    """Per-channel scales (this rank's output rows, as the weight's), or one per-tensor scale per checkpoint
    shard spread over its rows (the same on every rank)."""
    per_channel = shard_loader(layer, 0)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != 1:
            per_channel(param, loaded.reshape(-1), shard_id)   # [N] or compressed-tensors' [N, 1]
            return
        target = param.data
        if shard_id is not None:
            target = target.narrow(0, *layer.shard_offsets[shard_id])
        target.fill_(float(loaded.reshape(())))
    return load


def _ignore(param, loaded, shard_id=None) -> None:
    """Static input scales: activations are scaled per token here instead."""


class W8A8LinearMethod:
    def __init__(self, config: W8A8Config):
        self.config = config
        self.dtype = config.weight_dtype
        # the producer of this layer's input may quantize it per row itself (a QuantizedRows; see
        # layers/fusion.py), saving the quantization kernel in front of the GEMM
        self.input_quant_dtype = self.dtype

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        if not self.config.serialized:
            layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
            return
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=self.dtype), requires_grad=False)
        add_param(layer, "weight_scale", (output_size,), torch.float32, _scale_loader(layer))
        if getattr(self.config, "static_input_scale", False):
            add_param(layer, "input_scale", (1,), torch.float32, _ignore)

    @torch.no_grad()
    def init_dummy_weights(self, layer: nn.Module) -> None:
        """Codes spread over the 8-bit range, scales giving weights of std ~0.02."""
        if not self.config.serialized:
            return
        if self.dtype == FP8:
            layer.weight.copy_(torch.randn(layer.weight.shape, device=layer.weight.device).to(FP8))
            layer.weight_scale.fill_(0.02)
        else:
            layer.weight.random_(-127, 128)
            layer.weight_scale.fill_(0.02 / 73)   # uniform int8 codes have std ~73

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.serialized:
            codes, scale = quantize_rows_reference(layer.weight.data, self.dtype)
            replace_param(layer, "weight", codes)
            layer.weight_scale = nn.Parameter(scale.view(-1), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        if isinstance(x, QuantizedRows):
            x_codes, x_scale = x.codes, x.scales
        else:
            x_codes, x_scale = quantize_rows(x.reshape(-1, shape[-1]), self.dtype)
        gemm = w8a8_gemm if x.is_cuda else w8a8_reference
        out = gemm(x_codes, x_scale, layer.weight, layer.weight_scale, x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])
