"""CpuBlockPool: the swap space, CPU blocks holding the KV of sequences preempted by swapping.

A swapped-out sequence's GPU blocks are copied to CPU blocks and freed; swapping in takes fresh GPU
blocks and copies back. This pool only tracks which CPU blocks back each swapped sequence and hands the
`(src, dst)` pairs of both directions to the runner (through SchedulerOutput); it never touches KV data.
CPU blocks are private to one sequence (only sequences whose GPU blocks are all private are swapped), so
there are no reference counts here.
"""
from __future__ import annotations

from collections.abc import Iterable


class CpuBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be non-negative, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest first
        self.tables: dict[int, list[int]] = {}  # seq_id -> the CPU blocks holding its KV, in block-table order

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def take(self, seq_id: int, num_blocks: int) -> list[int]:
        assert seq_id not in self.tables and num_blocks <= len(self.free_blocks)
        table = [self.free_blocks.pop() for _ in range(num_blocks)]
        self.tables[seq_id] = table
        return table

    def release(self, seq_id: int) -> list[int]:
        """Give back the CPU blocks of `seq_id` (swapped in, or finished while swapped); returns them."""
        table = self.tables.pop(seq_id)
        self.free_blocks.extend(reversed(table))
        return table

    def check_integrity(self, swapped_seq_ids: Iterable[int] | None = None) -> None:
        held = [b for table in self.tables.values() for b in table]
        assert len(set(held)) == len(held), "a CPU block backs two sequences"
        assert not set(held) & set(self.free_blocks), "a CPU block is both free and held"
        assert len(set(self.free_blocks)) == len(self.free_blocks), "a CPU block is free twice"
        assert len(held) + len(self.free_blocks) == self.num_blocks, "CPU block counts do not add up"
        if swapped_seq_ids is not None:
            assert set(self.tables) == set(swapped_seq_ids), "CPU blocks held for a sequence that is not swapped"
