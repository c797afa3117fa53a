"""Which tensor-parallel rank this process is, of how many, and how sizes split across ranks.

One process per device, rendezvous the way `torchrun` does it (env://: MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK). Rank 0 is the driver: it alone runs the engine, the scheduler and the sampler;
every rank holds one shard of each parallel layer. Until `init_distributed` runs, the state is that of a
single process (rank 0 of 1) and the layers never call torch.distributed, so TP = 1 is unchanged.

Two groups: the device group (NCCL on CUDA, gloo on CPU) for the layers' collectives, and a gloo group
for the host-side step messages the driver broadcasts (pickled Python objects). The rendezvous store
carries each worker's progress (`report_progress`), so a stalled rank can be named.

Leaving the group never waits for a peer: NCCL communicators are aborted (a local operation) rather than
destroyed, because `ncclCommDestroy` synchronises with the other ranks and hangs when one of them is
already gone or still busy.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

_RANK, _SIZE = 0, 1
_TP_GROUP: dist.ProcessGroup | None = None
_CPU_GROUP: dist.ProcessGroup | None = None
_BACKEND: str | None = None
_PROGRESS_KEY = "minivllm/progress/{}"


def launched_by_torchrun() -> bool:
    """This process was started by torchrun (or another launcher that sets torchrun's environment)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    """Join the env:// rendezvous (MASTER_ADDR/MASTER_PORT must be set). Collectives that wait longer
    than `timeout_s` raise instead of hanging (a rank that died or is stuck)."""
    global _RANK, _SIZE, _TP_GROUP, _CPU_GROUP, _BACKEND
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    _TP_GROUP = dist.group.WORLD
    _CPU_GROUP = _TP_GROUP if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    _RANK, _SIZE, _BACKEND = rank, world_size, backend


def set_collective_timeout(timeout_s: float) -> None:
    """Deadline of every later collective of both groups (start-up may need a longer one than steps)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in {_TP_GROUP, _CPU_GROUP} - {None}:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def report_progress(steps: int) -> None:
    """A worker's count of steps launched, read by the driver's watchdog (`progress_of_ranks`)."""
    dist.distributed_c10d._get_default_store().set(_PROGRESS_KEY.format(_RANK), str(steps))


def progress_of_ranks() -> dict[int, int]:
    """{worker rank: steps it has launched} as last reported (0 before its first step)."""
    store = dist.distributed_c10d._get_default_store()
    progress = {}
    for rank in range(1, _SIZE):
        key = _PROGRESS_KEY.format(rank)
        progress[rank] = int(store.get(key)) if store.check([key]) else 0
    return progress


def abort_distributed() -> None:
    """Make every collective blocked on a peer (queued NCCL kernels included) fail now; local only."""
    if dist.is_initialized() and _BACKEND == "nccl":
        dist.distributed_c10d._abort_process_group()


def destroy_distributed() -> None:
    """Leave the group without waiting for any peer (see the module docstring)."""
    global _RANK, _SIZE, _TP_GROUP, _CPU_GROUP, _BACKEND
    if dist.is_initialized():
        if _BACKEND == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _RANK, _SIZE, _TP_GROUP, _CPU_GROUP, _BACKEND = 0, 1, None, None, None


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
