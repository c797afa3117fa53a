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
already gone or still busy. The abort itself runs on a daemon thread that callers wait for with a bound:
it stops the kernels blocked on a lost peer at once, but releasing the communicator waits for every CUDA
graph that holds its collectives to be dropped.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_RANK, _SIZE = 0, 1
_TP_GROUP: dist.ProcessGroup | None = None
_CPU_GROUP: dist.ProcessGroup | None = None
_BACKEND: str | None = None
_ABORT_DONE: threading.Event | None = None   # set once the NCCL abort (started at most once) has returned
# The process groups of an NCCL group this process has left, kept for the life of the process: dropping the last
# reference runs the NCCL group's destructor, which waits for its communicator, and with a rank lost the
# driver's shutdown blocked there on H200s (its main thread stuck at the reset of these globals).
_RETIRED: list = []
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


def abort_distributed(wait_s: float = 0.0) -> bool:
    """Make every collective blocked on a peer (queued NCCL kernels included) fail; local only. Started once,
    on a daemon thread (see the module docstring); returns whether it has finished within `wait_s`."""
    global _ABORT_DONE
    if _BACKEND != "nccl":
        return True
    if _ABORT_DONE is None:
        done = _ABORT_DONE = threading.Event()

        def abort() -> None:
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as e:   # already aborted or destroyed: nothing left to stop
                logger.warning("NCCL abort: %r", e)
            finally:
                done.set()
        threading.Thread(target=abort, name="minivllm-nccl-abort", daemon=True).start()
    return _ABORT_DONE.wait(wait_s)


def destroy_distributed(wait_s: float = 10.0) -> None:
    """Leave the group without waiting for any peer (see the module docstring); an NCCL abort still running
    after `wait_s` is left behind, logged (this process then cannot join another group)."""
    global _RANK, _SIZE, _TP_GROUP, _CPU_GROUP, _BACKEND, _ABORT_DONE
    if _BACKEND == "nccl":
        if not abort_distributed(wait_s):
            logger.error("the NCCL abort did not return within %.0f s; leaving the group without it", wait_s)
        _RETIRED.extend(group for group in (_TP_GROUP, _CPU_GROUP) if group is not None)
    elif dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE, _TP_GROUP, _CPU_GROUP, _BACKEND, _ABORT_DONE = 0, 1, None, None, None, None


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
    KV heads than ranks, query heads split evenly and each rank keeps replicas of the KV heads its query
    heads read (SmolLM2's 9 heads and 3 KV heads on 4 ranks: 3, 2, 2, 2 query heads reading KV heads
    {0}, {1}, {1, 2}, {2}). The attention kernels map a rank's query heads to its KV heads in equal runs,
    so a split that would give one KV head more of a rank's query heads than another is refused."""
    rank = get_tp_rank() if rank is None else rank
    size = get_tp_size() if size is None else size
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_count = split_evenly(num_kv_heads, size, rank)
        return kv_start * group, kv_count * group, kv_start, kv_count
    for r in range(size):   # every rank's split must fit, not only this one's
        q_start, q_count = split_evenly(num_heads, size, r)
        kv_start = q_start // group
        kv_count = (q_start + q_count - 1) // group + 1 - kv_start if q_count else 0
        runs = [min(q_start + q_count, (kv + 1) * group) - max(q_start, kv * group)
                for kv in range(kv_start, kv_start + kv_count)]
        if not q_count or len(set(runs)) != 1:
            raise ValueError(f"tensor_parallel_size {size} does not fit {num_heads} heads with {num_kv_heads} KV "
                             f"heads: rank {r}'s query heads would not read its KV heads in equal runs "
                             "(choose a size that divides the head count or the KV head count)")
        if r == rank:
            result = q_start, q_count, kv_start, kv_count
    return result
