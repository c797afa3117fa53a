"""Which tensor-parallel rank this process is, of how many, and how sizes split across ranks.

One process per device, rendezvous the way `torchrun` does it (env://: MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK). Rank 0 is the driver: it alone runs the engine, the scheduler and the sampler;
every rank holds one shard of each parallel layer. Until `init_distributed` runs, the state is that of a
single process (rank 0 of 1) and the layers never call torch.distributed, so TP = 1 is unchanged.

Two groups: the device group (NCCL on CUDA, gloo on CPU) for the layers' collectives, and a gloo group
for the host-side step messages the driver broadcasts (pickled Python objects).
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

_RANK, _SIZE = 0, 1
_TP_GROUP: dist.ProcessGroup | None = None
_CPU_GROUP: dist.ProcessGroup | None = None


def init_distributed(rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    """Join the env:// rendezvous (MASTER_ADDR/MASTER_PORT must be set). Collectives that wait longer
    than `timeout_s` raise instead of hanging (a rank that died or is stuck)."""
    global _RANK, _SIZE, _TP_GROUP, _CPU_GROUP
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    _TP_GROUP = dist.group.WORLD
    _CPU_GROUP = _TP_GROUP if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    _RANK, _SIZE = rank, world_size


def destroy_distributed() -> None:
    global _RANK, _SIZE, _TP_GROUP, _CPU_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE, _TP_GROUP, _CPU_GROUP = 0, 1, None, None


def get_tp_rank() -> int:
    return _RANK


def get_tp_size() -> int:
    return _SIZE


def is_driver() -> bool:
    return _RANK == 0


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def get_cpu_group() -> dist.ProcessGroup | None:
    return _CPU_GROUP


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `total` splits into `parts` near-equal contiguous pieces, the
    first `total % parts` one larger (SmolLM2's 1,536-wide MLP halves evenly; its 9 heads do not)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (index < extra)


def attention_head_partition(num_heads: int, num_kv_heads: int, rank: int | None = None,
                             size: int | None = None) -> tuple[int, int, int, int]:
    """(first q head, q heads, first kv head, kv heads) of this rank.

    KV heads split across ranks, each taking the query heads of its KV groups (so a query head always
    sits with its KV head; with 3 KV heads on 2 ranks one rank gets 2 groups, the other 1). With fewer
    KV heads than ranks, query heads split evenly and each rank keeps a replica of the one KV head its
    query heads read."""
    rank = get_tp_rank() if rank is None else rank
    size = get_tp_size() if size is None else size
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_count = split_evenly(num_kv_heads, size, rank)
        return kv_start * group, kv_count * group, kv_start, kv_count
    if size % num_kv_heads or num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not fit {num_heads} heads with {num_kv_heads} KV "
                         "heads: with fewer KV heads than ranks, the rank count must be a multiple of the KV "
                         "head count and divide the head count")
    q_count = num_heads // size
    q_start = rank * q_count
    return q_start, q_count, q_start // group, 1
