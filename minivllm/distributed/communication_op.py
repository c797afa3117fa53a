"""The collectives tensor parallelism needs, each a no-op with one rank.

Layers call `tensor_model_parallel_all_reduce` (row-parallel outputs, vocab-parallel embedding) and
`gather_to_driver` (vocab-parallel logits, only the driver samples). The executor uses the broadcasts
to ship each step's inputs from the driver, and `min_over_ranks` to agree on the KV cache size.

Every all-reduce goes through NCCL (docs/parallelism.md says why not symmetric memory for small ones).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from minivllm.distributed.parallel_state import get_cpu_group, get_tp_group, get_tp_rank, get_tp_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over ranks, in place (capturable in a CUDA graph with NCCL)."""
    if get_tp_size() == 1:
        return x
    dist.all_reduce(x, group=get_tp_group())
    return x


def gather_to_driver(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's `x` along `dim` on the driver; other ranks get None."""
    if get_tp_size() == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(get_tp_size())] if get_tp_rank() == 0 else None
    dist.gather(x, parts, dst=0, group=get_tp_group())
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """The driver's `x` into every rank's `x` (same shape and dtype on all), on the device group."""
    if get_tp_size() > 1:
        dist.broadcast(x, src=0, group=get_tp_group())
    return x


def broadcast_object(obj: Any = None) -> Any:
    """The driver's picklable `obj`, returned on every rank (host-side, over the gloo group)."""
    if get_tp_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=get_cpu_group())
    return box[0]


def min_over_ranks(value: int) -> int:
    """The smallest `value` any rank has (e.g. KV blocks that fit on every device)."""
    if get_tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_cpu_group())
    return int(t.item())
