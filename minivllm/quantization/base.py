"""What every quantization format provides, and the weight loaders its parameters share.

A `QuantizationConfig` is parsed from config.json's `quantization_config` (or made from the
`quantization=` option) and hands each linear layer a `LinearMethod`: `create_weights` declares the
format's on-disk tensors (each with its `weight_loader`), `process_weights_after_loading` turns them
once into what `apply` computes with. Packed layers (qkv_proj, gate_up_proj) receive one checkpoint
tensor per shard: `shard_loader` places it along the tensor's output dimension, which a format may pack
several values per element of. Under tensor parallelism `rank_part` first cuts this rank's part out of
the full checkpoint tensor, as the plain loaders of layers/linear.py do for dense weights: the layer's
output rows (column-parallel, each packed projection on its own) or its input columns (row-parallel),
counted in the tensor's own elements (packed words, groups of inputs).
"""
from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed import get_tp_rank, get_tp_size


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

    def get_moe_method(self, layer: nn.Module):
        """The method for a FusedMoE layer's experts, or None: experts in the model's dtype."""
        return None

    def describe(self) -> str:
        return self.name


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"shape mismatch{what}: parameter {tuple(target.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    target.copy_(loaded)


def _narrow(loaded: torch.Tensor, dim: int, start: int, size: int, per_element: int, what: str,
            unit: str = "packed word") -> torch.Tensor:
    """`what` (inputs or outputs) [start, start + size) of `loaded`, whose elements along `dim` hold
    `per_element` of them each: the range must fall on whole elements."""
    if start % per_element or size % per_element:
        raise ValueError(f"{what} {start}..{start + size} of rank {get_tp_rank()} (tensor_parallel_size "
                         f"{get_tp_size()}) are not whole {unit}s of {per_element} {what}; each rank's share "
                         f"must be a multiple of {per_element}")
    if (start + size) // per_element > loaded.shape[dim]:
        raise ValueError(f"{what} {start}..{start + size} of rank {get_tp_rank()} lie beyond the checkpoint "
                         f"tensor {tuple(loaded.shape)}")
    return loaded.narrow(dim, start // per_element, size // per_element)


def splits_inputs(layer: nn.Module) -> bool:
    """Whether this rank holds only part of `layer`'s inputs (a RowParallelLinear under TP)."""
    return get_tp_size() > 1 and hasattr(layer, "input_start")


def rank_part(layer: nn.Module, loaded: torch.Tensor, shard_id, output_dim: int | None, outputs_per_element: int = 1,
              input_dim: int | None = None, inputs_per_element: int = 1,
              input_unit: str = "packed word") -> torch.Tensor:
    """This rank's part of a full checkpoint tensor: a column-parallel layer's output rows (of packed
    projection `shard_id`, each split on its own), a row-parallel layer's input columns. A dim of None is
    not split (per-tensor values; per-output values of a row-parallel layer; one group over all inputs)."""
    if get_tp_size() == 1:
        return loaded
    if output_dim is not None and shard_id is not None:
        start, size = layer.shard_sources[shard_id], layer.shard_offsets[shard_id][1]
        loaded = _narrow(loaded, output_dim, start, size, outputs_per_element, "outputs")
    elif output_dim is not None and hasattr(layer, "output_start"):   # ColumnParallelLinear
        loaded = _narrow(loaded, output_dim, layer.output_start, layer.output_size, outputs_per_element, "outputs")
    if input_dim is not None and splits_inputs(layer):
        loaded = _narrow(loaded, input_dim, layer.input_start, layer.input_size, inputs_per_element, "inputs",
                         input_unit)
    return loaded


def shard_loader(layer: nn.Module, output_dim: int, packed_per_element: int = 1, input_dim: int | None = None,
                 inputs_per_element: int = 1, input_unit: str = "packed word"):
    """A weight_loader placing this rank's part (`rank_part`) of a checkpoint tensor, for a packed layer
    that of shard `shard_id` at its output rows / packing. An already-packed checkpoint tensor (Phi-3's
    qkv_proj) is split into its shards first when ranks cut each shard on its own."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offsets = getattr(layer, "shard_offsets", {})
        if shard_id is None and offsets and get_tp_size() > 1:
            for key, (start, size) in layer.full_shard_offsets.items():
                load(param, _narrow(loaded, output_dim, start, size, packed_per_element, "outputs"), key)
            return
        if shard_id is not None and shard_id not in offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(offsets)}")
        loaded = rank_part(layer, loaded, shard_id, output_dim, packed_per_element, input_dim, inputs_per_element,
                           input_unit)
        if shard_id is None:
            _copy_checked(param.data, loaded, "")
            return
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
