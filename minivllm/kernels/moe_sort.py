"""Sorting a MoE layer's routed slots by expert: one kernel program for a few hundred slots (decode steps), a
counting sort in three small kernels beyond (prefill), and the same in tensor operations as the reference.

A token routed to top_k experts occupies top_k slots (slot = token * top_k + k). Both grouped-GEMM paths need the
slots grouped by expert: the Triton grouped GEMM (`fused_moe.py`) in groups padded to whole BLOCK_M-row tiles,
torch's grouped GEMM (`moe_grouped_mm.py`) in jagged groups with the hidden rows gathered into that order.
The tensor operations of `moe_align_block_size` (an argsort and a dozen more) spend over a tenth of the
experts' time at 4,096 tokens (`moe_kernel` in bench/results/models_h200.json: `sort_us` against
`sort_tensor_ops_us`). The counting sort:

1. `_block_counts_kernel`: per block of BLOCK_S slots, how many go to each expert (a one-hot sum); padded, each
   program also fills its share of the rows with the sentinel;
2. `_group_starts_kernel` (one program): the experts' totals over the blocks, padded to BLOCK_M, give where each
   group starts and ends (a cursor per expert, set to its start) and each BLOCK_M-row tile's expert (-1 past the
   last group);
3. `_scatter_slots_kernel`: each slot takes the next row of its group by an atomic increment of its expert's
   cursor and writes its id there and, for the jagged layout, the row of each slot;
4. for the jagged layout, `_gather_rows_kernel` copies each sorted row's hidden row into place.

Slots land in their group in the order the atomics ran, which varies from run to run; the stable argsort keeps
the slot order. Every row of a grouped GEMM is computed on its own (the same products in the same order,
whichever rows share its tile), so each slot's result is the same bit for bit either way. The atomics replace a
running sum over a [slots, experts] one-hot per block and over the blocks per expert: at Qwen3-30B-A3B's 32,768
slots on an H200 the scan kernels took 16.8 and 19.7 us of the sort's 45.4 us under the profiler.

For few slots the three launches cost more than the work: `_align_kernel` does the padded sort in one program,
counting through a one-hot of each chunk of slots against the experts and then placing each slot by the
one-hot's running sum (`align_block_size` picks it up to ALIGN_KERNEL_MAX_SLOTS slots); it keeps the slot order.

Every buffer is sized by the shapes, so nothing waits on the host and a CUDA graph can hold it.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import launch_options, wait_for_previous


class SortedSlots(NamedTuple):
    sorted_ids: torch.Tensor         # [rows] int32 slot ids grouped by expert; padding rows hold num_slots
    expert_ids: torch.Tensor | None  # [rows // block_m] int32 each tile's expert, -1 past the last group
    ends: torch.Tensor               # [E] int32 where each expert's (padded) group ends
    position: torch.Tensor | None    # [slots] int32 each slot's row (with `gather`)
    rows: torch.Tensor | None        # [slots, H] the hidden rows in sorted order (with `gather`)


# A block's one-hot [BLOCK_S, BLOCK_E] of int32 and its running sum are staged in shared memory: 32k entries need
# 128 KiB (Hopper and A100 have more), 8k fit the 100 KiB of smaller GPUs.
ONE_HOT_ENTRIES = 32768
SMALL_SHARED_MEMORY_ONE_HOT_ENTRIES = 8192
SCATTER_BLOCK = 512            # slots a scatter program places
STARTS_CHUNK_ENTRIES = 4096    # counts the starts kernel sums at a time (a [blocks, experts] chunk)
TILE_CHUNK = tl.constexpr(32)  # tiles whose experts a program finds at a time


@functools.lru_cache(maxsize=8)
def _one_hot_entries(device: torch.device) -> int:
    if device.type != "cuda":
        return ONE_HOT_ENTRIES
    index = device.index if device.index is not None else torch.cuda.current_device()
    shared = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return ONE_HOT_ENTRIES if shared >= 160 * 1024 else SMALL_SHARED_MEMORY_ONE_HOT_ENTRIES


def padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded slot list: at most min(E, slots) groups are non-empty, each wasting fewer than
    block_m rows. An upper bound that depends only on the shapes."""
    return triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m


@triton.jit
def slot_onehot(ids_ptr, offs, num_slots, BLOCK_E: tl.constexpr):
    """[len(offs), BLOCK_E] int32: 1 where slot offs[i] is routed to expert e (no 1 in rows past num_slots)."""
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    return (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)


@triton.jit
def rows_in_groups(onehot, first):
    """Each slot's sorted row: its expert's `first` free row plus its rank among the chunk's slots of that expert
    (the one-hot's running sum down the slots), so slots keep their order within a group."""
    return tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + first[None, :]), axis=1)


@triton.jit
def store_tile_experts(ends, expert_ids_ptr, num_experts, first_tile, end_tile, BLOCK_M: tl.constexpr,
                       BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """The expert of each BLOCK_M-row tile in [first_tile, end_tile), from the padded groups' ends: how many groups
    end at or before its first row (-1 past the last group)."""
    experts = tl.arange(0, BLOCK_E)
    for t0 in range(first_tile, end_tile, CHUNK):
        tiles = t0 + tl.arange(0, CHUNK)
        before = (ends[None, :] <= (tiles * BLOCK_M)[:, None]) & (experts < num_experts)[None, :]
        expert = tl.sum(before.to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + tiles, tl.where(expert < num_experts, expert, -1), mask=tiles < end_tile)


# Slot, block and tile counts change with every eager step: specialising on them would recompile mid-run.
@triton.jit(do_not_specialize=["num_slots", "num_rows", "rows_per_block"])
def _block_counts_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, num_slots, num_rows, rows_per_block,
                         FILL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """counts[b, e]; with FILL, this program's share of the sorted rows gets the sentinel (the scatter, two kernels
    later, overwrites the slots' rows)."""
    wait_for_previous(PDL)
    block = tl.program_id(0)
    counts = tl.sum(slot_onehot(ids_ptr, block * BLOCK_S + tl.arange(0, BLOCK_S), num_slots, BLOCK_E), axis=0)
    tl.store(counts_ptr + block * BLOCK_E + tl.arange(0, BLOCK_E), counts)
    if FILL:
        first = block * rows_per_block
        for r0 in range(0, rows_per_block, BLOCK_S):
            rows = first + r0 + tl.arange(0, BLOCK_S)
            tl.store(sorted_ids_ptr + rows, tl.zeros_like(rows) + num_slots,
                     mask=(rows < num_rows) & (rows < first + rows_per_block))


@triton.jit(do_not_specialize=["num_blocks"])
def _group_starts_kernel(counts_ptr, cursor_ptr, ends_ptr, num_blocks, num_experts, BLOCK_M: tl.constexpr,
                         BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """cursor[e]: where expert e's padded group starts, ends[e]: where it ends."""
    wait_for_previous(PDL)
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        counts = tl.load(counts_ptr + blocks[:, None] * BLOCK_E + experts[None, :],
                         mask=blocks[:, None] < num_blocks, other=0)
        total += tl.sum(counts, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + experts, ends - padded)
    tl.store(ends_ptr + experts, ends, mask=experts < num_experts)


@triton.jit(do_not_specialize=["num_slots", "num_tiles", "tiles_per_program"])
def _scatter_slots_kernel(ids_ptr, cursor_ptr, ends_ptr, sorted_ids_ptr, position_ptr, expert_ids_ptr, num_slots,
                          num_experts, num_tiles, tiles_per_program, POSITION: tl.constexpr, TILES: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """Each of this program's slots takes the next row of its expert's group; with TILES, this program's share of
    the tiles gets their experts."""
    wait_for_previous(PDL)
    offs = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    in_range = offs < num_slots
    expert = tl.load(ids_ptr + offs, mask=in_range, other=0)
    row = tl.atomic_add(cursor_ptr + expert, tl.full((BLOCK_S,), 1, tl.int32), mask=in_range, sem="relaxed")
    tl.store(sorted_ids_ptr + row, offs, mask=in_range)
    if POSITION:
        tl.store(position_ptr + offs, row, mask=in_range)
    if TILES:
        experts = tl.arange(0, BLOCK_E)
        ends = tl.load(ends_ptr + experts, mask=experts < num_experts, other=0)
        first = tl.program_id(0) * tiles_per_program
        store_tile_experts(ends, expert_ids_ptr, num_experts, first, tl.minimum(first + tiles_per_program, num_tiles),
                           BLOCK_M, BLOCK_E, TILE_CHUNK)


@triton.jit(do_not_specialize=["num_slots"])
def _gather_rows_kernel(x_ptr, sorted_ids_ptr, rows_ptr, num_slots, H, stride_x, stride_rows, TOP_K: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """rows[r] = x[sorted_ids[r] // TOP_K]: BLOCK_R sorted rows by BLOCK_H columns a program."""
    wait_for_previous(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (r < num_slots)[:, None] & (cols < H)[None, :]
    src = (tl.load(sorted_ids_ptr + r, mask=r < num_slots, other=0) // TOP_K).to(tl.int64)
    values = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=mask)
    tl.store(rows_ptr + r.to(tl.int64)[:, None] * stride_rows + cols[None, :], values, mask=mask)


@triton.jit
def token_slots(per_slot_ptr, TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
                LOAD: tl.constexpr = True):
    """For a program over (token, BLOCK_N columns): the token's TOP_K slots in a BLOCK_TOPK vector, which of them are
    real, each one's int64 entry of `per_slot_ptr` (its expert, or its sorted row; without LOAD the slot itself)
    and the program's columns."""
    token = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_TOPK)
    k_valid = ks < TOP_K
    slots = token * TOP_K + ks
    if LOAD:
        entries = tl.load(per_slot_ptr + slots, mask=k_valid, other=0).to(tl.int64)
    else:
        entries = slots
    return token, slots, k_valid, entries, tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)


def sort_slots(topk_ids: torch.Tensor, num_experts: int, block_m: int = 1,
               hidden_states: torch.Tensor | None = None) -> SortedSlots:
    """Group topk_ids' [T, top_k] slots by expert (in no set order within a group): groups padded to multiples
    of `block_m` with each tile's expert (block_m > 1), or, given `hidden_states`, jagged groups with each slot's
    row and the hidden rows gathered into the sorted order (block_m must be 1)."""
    gather = hidden_states is not None
    if gather and block_m != 1:
        raise ValueError("gathered rows are sorted into jagged groups: block_m must be 1")
    ids = topk_ids.reshape(-1)
    num_slots, top_k = ids.numel(), topk_ids.shape[-1]
    if num_slots == 0:
        raise ValueError("no slots to sort")
    device = ids.device
    block_e = triton.next_power_of_2(num_experts)
    # Blocks as wide as the one-hot allows, since the starts kernel's one program walks the blocks in turn.
    entries = _one_hot_entries(device)
    block_s = max(16, min(1024, entries // block_e))
    num_blocks = triton.cdiv(num_slots, block_s)
    num_rows = padded_rows(num_slots, num_experts, block_m) if block_m > 1 else num_slots
    counts = torch.empty((num_blocks, block_e), dtype=torch.int32, device=device)
    cursor = torch.empty(block_e, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(num_rows, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_rows // block_m, dtype=torch.int32, device=device) if block_m > 1 else None
    position = torch.empty(num_slots, dtype=torch.int32, device=device) if gather else None
    rows = torch.empty((num_slots, hidden_states.shape[1]), dtype=hidden_states.dtype,
                       device=device) if gather else None
    pdl = launch_options(device)
    _block_counts_kernel[(num_blocks,)](ids, counts, sorted_ids, num_slots, num_rows,
                                        triton.cdiv(num_rows, num_blocks), FILL=block_m > 1, BLOCK_S=block_s,
                                        BLOCK_E=block_e, **pdl, num_warps=8)
    chunk = max(1, min(triton.next_power_of_2(num_blocks), STARTS_CHUNK_ENTRIES // block_e))
    _group_starts_kernel[(1,)](counts, cursor, ends, num_blocks, num_experts, BLOCK_M=block_m, BLOCK_E=block_e,
                               CHUNK=chunk, **pdl, num_warps=4)
    num_programs = triton.cdiv(num_slots, SCATTER_BLOCK)
    num_tiles = num_rows // block_m
    _scatter_slots_kernel[(num_programs,)](
        ids, cursor, ends, sorted_ids, position if gather else sorted_ids,
        sorted_ids if expert_ids is None else expert_ids, num_slots, num_experts, num_tiles,
        triton.cdiv(num_tiles, num_programs), POSITION=gather, TILES=block_m > 1, BLOCK_M=block_m,
        BLOCK_S=SCATTER_BLOCK, BLOCK_E=block_e, **pdl, num_warps=4)
    if gather:
        hidden = hidden_states.shape[1]
        block_h = min(512, triton.next_power_of_2(hidden))
        _gather_rows_kernel[(triton.cdiv(num_slots, 8), triton.cdiv(hidden, block_h))](
            hidden_states, sorted_ids, rows, num_slots, hidden, hidden_states.stride(0), rows.stride(0), TOP_K=top_k,
            BLOCK_R=8, BLOCK_H=block_h, **pdl, num_warps=4)
    return SortedSlots(sorted_ids, expert_ids, ends, position, rows)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [M, top_k] -> (sorted_slot_ids [S], expert_ids [S // block_m]): slots grouped by
    expert, each group padded to a multiple of block_m with the sentinel M * top_k; a tile's expert is
    -1 past the last group. S is an upper bound that depends only on the shapes."""
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    device = flat.device
    # scatter_add, not bincount: bincount on CUDA syncs to size its output (no CUDA graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_group = torch.arange(num_slots, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    destination = (padded_end - padded)[sorted_experts] + rank_in_group
    max_rows = padded_rows(num_slots, num_experts, block_m)
    sorted_ids = torch.full((max_rows,), num_slots, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, destination, order.to(torch.int32))
    tile_starts = torch.arange(0, max_rows, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, tile_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids


@triton.jit
def _align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_slots, num_experts, num_rows,
                  BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
                  PDL: tl.constexpr):
    """`moe_align_block_size` in one program: per chunk of BLOCK_S slots a one-hot [BLOCK_S, BLOCK_E] of their
    experts gives the per-expert counts (first pass) and, through its running sum down the slots, each slot's
    rank in its expert's group (second pass), so slots keep their order within a group, as the stable sort's."""
    wait_for_previous(PDL)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for s0 in range(0, num_slots, BLOCK_S):
        counts += tl.sum(slot_onehot(ids_ptr, s0 + tl.arange(0, BLOCK_S), num_slots, BLOCK_E), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    store_tile_experts(ends, expert_ids_ptr, num_experts, 0, num_rows // BLOCK_M, BLOCK_M, BLOCK_E, BLOCK_T)
    for r0 in range(0, num_rows, BLOCK_T * BLOCK_M):   # padding rows hold the sentinel
        rows = r0 + tl.arange(0, BLOCK_T * BLOCK_M)
        tl.store(sorted_ids_ptr + rows, tl.zeros_like(rows) + num_slots, mask=rows < num_rows)
    tl.debug_barrier()   # the sentinels land before any slot's id overwrites one
    cursor = ends - padded
    for s0 in range(0, num_slots, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        onehot = slot_onehot(ids_ptr, offs, num_slots, BLOCK_E)
        tl.store(sorted_ids_ptr + rows_in_groups(onehot, cursor), offs, mask=offs < num_slots)
        cursor += tl.sum(onehot, axis=0)


# One program's one-hot passes cost O(slots x experts). At Qwen3-30B-A3B's routing on an H200 the one program took
# 6.3 against 6.7 µs for the counting sort's three kernels at 64 slots, 10.8 against 8.3 at 128 and 30.4 against 9.2
# at 512 (`align_kernel_us`, `sort_us` in bench/results/models_h200.json's kernel table).
ALIGN_KERNEL_MAX_SLOTS = 64


def align_one_program(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`moe_align_block_size` (same outputs) in `_align_kernel`'s one program."""
    num_slots = topk_ids.numel()
    num_rows = padded_rows(num_slots, num_experts, block_m)
    sorted_ids = torch.empty(num_rows, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.empty(num_rows // block_m, dtype=torch.int32, device=topk_ids.device)
    block_e = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](topk_ids.reshape(-1), sorted_ids, expert_ids, num_slots, num_experts, num_rows,
                        BLOCK_M=block_m, BLOCK_S=max(16, min(128, 8192 // block_e)), BLOCK_E=block_e, BLOCK_T=64,
                        **launch_options(topk_ids.device), num_warps=8)
    return sorted_ids, expert_ids


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`moe_align_block_size`, where the tensor operations are a dozen launches of a few microseconds each per
    MoE layer: in one program up to ALIGN_KERNEL_MAX_SLOTS slots (the same outputs), by the multi-program
    counting sort beyond (the same groups and tiles, each group's slots in the order its atomics ran)."""
    if topk_ids.numel() > ALIGN_KERNEL_MAX_SLOTS or num_experts > 1024:
        sorted_slots = sort_slots(topk_ids, num_experts, block_m)
        return sorted_slots.sorted_ids, sorted_slots.expert_ids
    return align_one_program(topk_ids, num_experts, block_m)
