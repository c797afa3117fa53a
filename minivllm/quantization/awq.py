"""AWQ checkpoints as AutoAWQ writes them (`quant_method: "awq"`, version "gemm", 4 bits).

Per linear layer with K inputs, N outputs and G = K / group_size groups:
  qweight [K, N / 8] int32  codes packed along the output dimension, 8 per word in AWQ's interleaved
                            order: field i of word c holds output column c * 8 + AWQ_ORDER[i];
  qzeros  [G, N / 8] int32  zero points packed the same way (no offset);
  scales  [G, N] fp16.
W[k, n] = (code[k, n] - zero[k // group_size, n]) * scales[k // group_size, n].
"""
from __future__ import annotations

import torch
from torch import nn

from minivllm.quantization.base import QuantizationConfig, add_param, shard_loader
from minivllm.quantization.packing import pack_rows, unpack_cols
from minivllm.quantization.weight_only import WeightOnlyLinearMethod

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, bits: int, group_size: int, zero_point: bool):
        if bits != 4:
            raise ValueError(f"AWQ supports 4 bits, got {bits}")
        self.bits, self.group_size, self.zero_point = bits, group_size, zero_point

    @classmethod
    def from_config(cls, config: dict) -> "AWQConfig":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only 'gemm')")
        return cls(int(config.get("bits", config.get("w_bit", 4))),
                   int(config.get("group_size", config.get("q_group_size", 128))), bool(config.get("zero_point", True)))

    def describe(self) -> str:
        return f"awq (int4, group {self.group_size})"

    def get_quant_method(self, layer: nn.Module):
        return AWQLinearMethod(self)


class AWQLinearMethod(WeightOnlyLinearMethod):
    def __init__(self, config: AWQConfig):
        super().__init__(config.bits, config.group_size)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        if output_size % 8 or input_size % 8:
            raise ValueError(f"AWQ needs layer sizes divisible by 8, got {input_size}x{output_size}")
        _, groups = self.groups(input_size)
        add_param(layer, "qweight", (input_size, output_size // 8), torch.int32, shard_loader(layer, 1, 8, 0))
        add_param(layer, "qzeros", (groups, output_size // 8), torch.int32, self.group_loader(layer, 1, 8))
        add_param(layer, "scales", (groups, output_size), torch.get_default_dtype(), self.group_loader(layer, 1))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        N = layer.output_size
        codes = unpack_cols(layer.qweight.data, 4, N, AWQ_ORDER)
        zeros = unpack_cols(layer.qzeros.data, 4, N, AWQ_ORDER)
        self.set_processed(layer, pack_rows(codes, 4), layer.scales.data, zeros, layer.scales.dtype)
