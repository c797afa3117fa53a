"""What every quantization format provides, and the weight loaders its parameters share.

A `QuantizationConfig` is parsed from config.json's `quantization_config` (or made from the
`quantization=` option) and hands each linear layer a `LinearMethod`: `create_weights` declares the
format's on-disk tensors (each with its `weight_loader`), `process_weights_after_loading` turns them
once into what `apply` computes with. Packed layers (qkv_proj, gate_up_proj) receive one checkpoint
tensor per shard: `shard_loader` places it along the tensor's output dimension, which a format may pack
several values per element of.
"""
from __future__ import annotations

import torch
from torch import nn


class QuantizationConfig:
    name: str = ""
    quantizes_lm_head: bool = False   # the checkpoint stores the LM head in the format too (GPTQ `lm_head`)

    @classmethod
    def from_config(cls, config: dict) -> "QuantizationConfig":
        raise NotImplementedError

    @classmethod
    def for_dummy(cls) -> "QuantizationConfig":
        """The format's usual settings, for random weights created directly in it (benchmarks)."""
        return cls.from_config({"quant_method": cls.name})

    def get_quant_method(self, layer: nn.Module):
        """The LinearMethod for `layer` (a LinearBase)."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"shape mismatch{what}: parameter {tuple(target.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    target.copy_(loaded)


def shard_loader(layer: nn.Module, output_dim: int, packed_per_element: int = 1):
    """A weight_loader placing shard `shard_id` of a packed layer at its output rows / packing."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            _copy_checked(param.data, loaded, "")
            return
        offsets = getattr(layer, "shard_offsets", {})
        if shard_id not in offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(offsets)}")
        start, size = offsets[shard_id]
        if start % packed_per_element or size % packed_per_element:
            raise ValueError(f"shard {shard_id!r} ({size} outputs) does not split the packing "
                             f"({packed_per_element} per element)")
        target = param.data.narrow(output_dim, start // packed_per_element, size // packed_per_element)
        _copy_checked(target, loaded, f" for shard {shard_id!r}")
    return load


def shared_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Tensors every shard of a packed layer stores alike (GPTQ's g_idx: all shards see the same
    input, so act-order permutes their inputs identically); a shard that differs is rejected."""
    if shard_id is not None and getattr(param, "loaded_once", False):
        if not torch.equal(param.data, loaded.to(param.device, param.dtype)):   # checkpoints load on the CPU
            raise ValueError("shards of a packed layer disagree on a shared tensor (g_idx)")
        return
    _copy_checked(param.data, loaded, "")
    param.loaded_once = True


def add_param(layer: nn.Module, name: str, shape, dtype: torch.dtype, weight_loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = weight_loader
    layer.register_parameter(name, param)
    return param


def replace_param(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Swap a loaded parameter for its processed form (may change shape and dtype)."""
    delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
