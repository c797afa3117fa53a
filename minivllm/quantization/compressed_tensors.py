"""compressed-tensors checkpoints (llm-compressor's `quant_method: "compressed-tensors"`).

W8A8 (`float-quantized` fp8 or `int-quantized` int8, per-channel weights, dynamic per-token activations:
llm-compressor's FP8_DYNAMIC and W8A8 schemes) is handed to the fp8 / int8 W8A8 method: `weight` holds the
8-bit codes and `weight_scale` [N, 1] the per-channel scales. Weight-only, the `pack-quantized` format:
integer weights with group (or channel) scales, symmetric.

Per linear layer with K inputs and N outputs (one config group targeting Linear layers):
  weight_packed [N, K / pf] int32  signed codes q in [-2^(b-1), 2^(b-1)) stored as q + 2^(b-1),
                                   packed along the input dimension (field i of word c is input c*pf+i);
  weight_scale  [N, G];            weight_shape [2] = (N, K).
W[n, k] = q[n, k] * weight_scale[n, k // group_size]. Layers in `ignore` (lm_head) stay unquantized.
"""
from __future__ import annotations

import torch
from torch import nn

from minivllm.quantization.base import QuantizationConfig, add_param, shard_loader, splits_inputs
from minivllm.quantization.packing import pack_factor, pack_rows, unpack_cols
from minivllm.quantization.weight_only import WeightOnlyLinearMethod


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, bits: int, group_size: int):
        pack_factor(bits)
        self.bits, self.group_size = bits, group_size

    @classmethod
    def from_config(cls, config: dict) -> QuantizationConfig:
        if config.get("format") in ("float-quantized", "int-quantized"):
            return _w8a8_config(config)
        if config.get("format") != "pack-quantized":
            raise ValueError(f"compressed-tensors format {config.get('format')!r} is not supported "
                             "(only 'pack-quantized')")
        group = _only_group(config)
        weights = group["weights"]
        if group.get("input_activations"):
            raise ValueError("compressed-tensors: only weight-only schemes are supported")
        if weights.get("type", "int") != "int" or not weights.get("symmetric", True):
            raise ValueError("compressed-tensors: only symmetric integer weights are supported")
        strategy = weights.get("strategy", "group")
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors: unsupported strategy {strategy!r}")
        group_size = int(weights.get("group_size") or -1) if strategy == "group" else -1
        return cls(int(weights.get("num_bits", 4)), group_size)

    @classmethod
    def for_dummy(cls) -> "CompressedTensorsConfig":
        return cls(4, 128)

    def describe(self) -> str:
        return f"compressed-tensors (int{self.bits}, group {self.group_size})"

    def get_quant_method(self, layer: nn.Module):
        return CompressedTensorsLinearMethod(self)


def _only_group(config: dict) -> dict:
    """The one config group (with weight settings) these schemes are written with."""
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1 or "weights" not in groups[0]:
        raise ValueError("compressed-tensors: expected exactly one config group with weight settings")
    return groups[0]


def _w8a8_config(config: dict) -> QuantizationConfig:
    """The fp8 / int8 W8A8 config of an 8-bit float-/int-quantized scheme with dynamic per-token inputs."""
    from minivllm.quantization.fp8 import Fp8Config
    from minivllm.quantization.int8 import Int8Config
    group = _only_group(config)
    weights, inputs = group["weights"], group.get("input_activations") or {}
    kind = "float" if config["format"] == "float-quantized" else "int"
    if weights.get("num_bits") != 8 or weights.get("type", "int") != kind or weights.get("strategy") != "channel":
        raise ValueError(f"compressed-tensors {config['format']}: only 8-bit {kind} weights with per-channel "
                         "scales are supported")
    if not weights.get("symmetric", True):
        raise ValueError(f"compressed-tensors {config['format']}: only symmetric weights are supported")
    if not (inputs.get("num_bits") == 8 and inputs.get("type", "int") == kind and inputs.get("dynamic")
            and inputs.get("strategy") == "token"):
        raise ValueError(f"compressed-tensors {config['format']}: activations must be 8-bit {kind}, dynamic per "
                         "token (weight-only 8-bit and static input scales are not supported)")
    return (Fp8Config if kind == "float" else Int8Config)(serialized=True)


def _shape_checker(layer: nn.Module):
    """weight_shape is implied by the layer; only its input size can be checked per shard (a row-parallel
    rank's inputs must lie within it)."""
    def check(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        inputs = int(loaded.reshape(-1)[-1])
        if inputs != layer.input_size and not (splits_inputs(layer) and layer.input_start + layer.input_size <= inputs):
            raise ValueError(f"weight_shape {loaded.tolist()} does not match {layer.input_size} inputs")
    return check


class CompressedTensorsLinearMethod(WeightOnlyLinearMethod):
    symmetric = True

    def __init__(self, config: CompressedTensorsConfig):
        super().__init__(config.bits, config.group_size)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        pf = pack_factor(self.bits)
        if input_size % pf:
            raise ValueError(f"pack-quantized int{self.bits} needs inputs divisible by {pf}, got {input_size}")
        _, groups = self.groups(input_size)
        add_param(layer, "weight_packed", (output_size, input_size // pf), torch.int32,
                  shard_loader(layer, 0, 1, 1, pf))
        add_param(layer, "weight_scale", (output_size, groups), torch.get_default_dtype(), self.group_loader(layer, 0))
        add_param(layer, "weight_shape", (2,), torch.int64, _shape_checker(layer))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes = unpack_cols(layer.weight_packed.data, self.bits, layer.input_size).t()   # [K, N], offset by 2^(b-1)
        scales = layer.weight_scale.data.t()
        zeros = torch.full_like(scales, float(1 << (self.bits - 1)))
        self.set_processed(layer, pack_rows(codes, self.bits), scales, zeros, layer.weight_scale.dtype)
