"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Each parameter carries `weight_loader(param, loaded_weight, shard_id=None)`; packed layers
(`QKVParallelLinear`, `MergedColumnParallelLinear`) place each checkpoint tensor in its slice, so the
model only declares which checkpoint names pack into which parameter. The matmul goes through
`self.quant_method`, the hook a quantized format replaces (it owns both the parameters it creates and
how they are applied). Under tensor parallelism (minivllm.distributed) each rank creates only its shard
and its weight_loader cuts that shard out of the full checkpoint tensor: column-parallel layers split
output rows, row-parallel layers split input columns and all-reduce their output. With one rank every
layer is a plain linear. Must not touch attention metadata or the KV cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import (attention_head_partition, get_tp_rank, get_tp_size, split_evenly,
                                  tensor_model_parallel_all_reduce)
from minivllm.kernels import dense_gemv
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
        if dense_gemv.supports(x, layer.weight):   # batch-1 decode: cuBLAS or a GEMV, as timed per shape
            return dense_gemv.linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    # At one row on the GPU, a projection with a small grid (an MoE router) or rows the GEMV's streaming tiles take
    # runs the decoder layer's norm before it in its GEMV (layers/fusion.PendingNorm, kernels/dense_gemv.folds_norm).
    def norms_input(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return dense_gemv.folds_norm(x, layer.weight)

    def apply_normed(self, layer: nn.Module, x: torch.Tensor, norm, keep_input: bool = False):
        """(layer(norm's output), that output if keep_input else None) from one GEMV, where `norms_input` (x is the
        PendingNorm `norm`'s un-normed x); else None."""
        if not self.norms_input(layer, x):
            return None
        normed = torch.empty_like(x) if keep_input else None
        row_norm = norm.row_norm(None if normed is None else normed.view(1, -1))
        out = dense_gemv.linear(x.view(1, -1), layer.weight, layer.bias, norm=row_norm)
        return out.view(*x.shape[:-1], -1), normed


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
    """Output dimension split across ranks: this rank holds rows [output_start, +output_size) of W and b
    (`output_partition` overrides the even split)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None,
                 output_partition: tuple[int, int] | None = None):
        self.output_start, local_size = output_partition or split_evenly(output_size, get_tp_size(), get_tp_rank())
        super().__init__(input_size, local_size, bias, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if get_tp_size() > 1 and shard_id is None:
            loaded_weight = loaded_weight.narrow(0, self.output_start, self.output_size)
        default_weight_loader(param, loaded_weight, shard_id)


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks (columns [input_start, +input_size) of W, `input_partition`
    overriding the even split); the partial products are all-reduced, then the whole bias added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None,
                 input_partition: tuple[int, int] | None = None):
        self.input_start, local_size = input_partition or split_evenly(input_size, get_tp_size(), get_tp_rank())
        super().__init__(local_size, output_size, bias, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if get_tp_size() > 1 and param is not self.bias:
            loaded_weight = loaded_weight.narrow(1, self.input_start, self.input_size)
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return super().forward(x)
        y = tensor_model_parallel_all_reduce(self.quant_method.apply(self, x, None))
        return y if self.bias is None else y + self.bias


class PackedColumnLinear(ColumnParallelLinear):
    """Several checkpoint projections of the same input stacked along the output dimension, so one
    matmul computes all of them. `shard_offsets[shard_id] = (start, size)` in output rows of the full
    packed weight; under TP each projection is split on its own (`shard_partitions[shard_id] = (first
    checkpoint row, rows)` of this rank, default even) and this rank stacks its pieces, so
    `self.shard_offsets` are the local offsets."""

    def __init__(self, input_size: int, shard_offsets: dict, bias: bool = False, quant_method=None,
                 shard_partitions: dict | None = None):
        self.full_shard_offsets = dict(shard_offsets)
        parts = shard_partitions or {k: split_evenly(size, get_tp_size(), get_tp_rank())
                                     for k, (_, size) in shard_offsets.items()}
        self.shard_offsets, start = {}, 0
        for k in shard_offsets:
            self.shard_offsets[k] = (start, parts[k][1])
            start += parts[k][1]
        self.shard_sources = {k: parts[k][0] for k in shard_offsets}
        super().__init__(input_size, start, bias, quant_method, output_partition=(0, start))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:   # an already-packed checkpoint tensor
            if get_tp_size() == 1:
                default_weight_loader(param, loaded_weight)
                return
            for k, (full_start, full_size) in self.full_shard_offsets.items():
                self.weight_loader(param, loaded_weight.narrow(0, full_start, full_size), k)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_offsets)}")
        start, size = self.shard_offsets[shard_id]
        if get_tp_size() > 1:
            full_size = self.full_shard_offsets[shard_id][1]
            if loaded_weight.shape[0] != full_size:
                raise ValueError(f"shape mismatch for shard {shard_id!r}: {full_size} rows expected, checkpoint "
                                 f"has {tuple(loaded_weight.shape)}")
            loaded_weight = loaded_weight.narrow(0, self.shard_sources[shard_id], size)
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
    """q, k and v projections in one matmul; output is [q (H*D) | k (KVH*D) | v (KVH*D)] of this rank's
    heads (`num_heads`, `num_kv_heads`; see `attention_head_partition`). `q_partition` is the slice of
    the attention output this rank produces: the input partition of the row-parallel o_proj."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, quant_method=None):
        q_size = total_num_heads * head_size
        kv_size = total_num_kv_heads * head_size
        offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        q_start, self.num_heads, kv_start, self.num_kv_heads = attention_head_partition(
            total_num_heads, total_num_kv_heads)
        self.q_partition = (q_start * head_size, self.num_heads * head_size)
        kv_partition = (kv_start * head_size, self.num_kv_heads * head_size)
        super().__init__(hidden_size, offsets, bias, quant_method,
                         {"q": self.q_partition, "k": kv_partition, "v": kv_partition})
