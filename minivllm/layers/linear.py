"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Each parameter carries `weight_loader(param, loaded_weight, shard_id=None)`; packed layers
(`QKVParallelLinear`, `MergedColumnParallelLinear`) place each checkpoint tensor in its slice, so the
model only declares which checkpoint names pack into which parameter. The matmul goes through
`self.quant_method`, the hook a quantized format replaces (it owns both the parameters it creates and
how they are applied). Tensor parallelism is not implemented: the "Parallel" names say which dimension
a future sharding splits, as in vLLM. Must not touch attention metadata or the KV cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.quantization import current_quant_method


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Copy a whole checkpoint tensor into `param`; a shape mismatch is a bad checkpoint, not a bug."""
    assert shard_id is None, "an unpacked parameter has no shards"
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


class UnquantizedLinearMethod:
    """Plain dense weights: `weight` [out, in] and `y = x @ weight.T + bias`."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    """y = x W^T + b. Subclasses decide how checkpoint tensors map onto W and b."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.quant_method = quant_method or current_quant_method(self) or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, output_size)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):   # a quant method may bring its own loaders
                param.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output dimension would be split across ranks; with one rank it is a plain linear."""


class RowParallelLinear(LinearBase):
    """Input dimension would be split across ranks (all-reduce after); with one rank a plain linear."""


class PackedColumnLinear(ColumnParallelLinear):
    """Several checkpoint projections of the same input stacked along the output dimension, so one
    matmul computes all of them. `shard_offsets[shard_id] = (start, size)` in output rows."""

    def __init__(self, input_size: int, shard_offsets: dict, bias: bool = False, quant_method=None):
        self.shard_offsets = dict(shard_offsets)
        output_size = sum(size for _, size in self.shard_offsets.values())
        super().__init__(input_size, output_size, bias, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:   # an already-packed checkpoint tensor
            default_weight_loader(param, loaded_weight)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_offsets)}")
        start, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, start, size)
        if target.shape != loaded_weight.shape:
            raise ValueError(f"shape mismatch for shard {shard_id!r}: parameter slice "
                             f"{tuple(target.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
        target.copy_(loaded_weight)


class MergedColumnParallelLinear(PackedColumnLinear):
    """Projections stacked in order, shard ids 0, 1, ... (gate_up_proj: gate = 0, up = 1)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, quant_method=None):
        offsets, start = {}, 0
        for i, size in enumerate(output_sizes):
            offsets[i] = (start, size)
            start += size
        super().__init__(input_size, offsets, bias, quant_method)


class QKVParallelLinear(PackedColumnLinear):
    """q, k and v projections in one matmul; output is [q (H*D) | k (KVH*D) | v (KVH*D)]."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, quant_method=None):
        q_size = total_num_heads * head_size
        kv_size = total_num_kv_heads * head_size
        offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        super().__init__(hidden_size, offsets, bias, quant_method)
