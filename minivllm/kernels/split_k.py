"""Split-K, shared by the quantized GEMMs: how many K slices, each program's tile and K range, and the
last step, out[m, n] = sum over s of partials[s, m, n] cast to the output dtype, in one kernel (torch's
sum then cast took two, each a few microseconds at decode sizes) or inside the GEMM: each tile's last K
slice to finish sums them (`sum_slices_in_last`, a ticket counter per tile from `tile_tickets`), saving
the second kernel at batch 1. Reference: `partials.sum(0).to(dtype)`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import launch_options, wait_for_previous
from minivllm.kernels.tuning import note_deferred_under_capture


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def choose_split_k(M: int, N: int, K: int, block_m: int, block_n: int, block_k: int, sms: int,
                   fill: int = 2) -> int:
    """K split until the grid has about `fill` programs per SM (each keeping two K steps at least)."""
    programs = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    return max(1, min(K // (2 * block_k), triton.cdiv(fill * sms, programs)))


def k_slices(K: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(K per slice, a whole number of BLOCK_K steps; the number of slices that leaves)."""
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    return k_per_split, triton.cdiv(K, k_per_split)


@triton.jit
def split_k_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows, columns (with masks) and K range, for a grid (M tiles, N tiles, slices)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_per_split
    return offs_m, offs_n, offs_m < M, offs_n < N, k_start, tl.minimum(k_start + k_per_split, K)


@triton.jit
def _sum_partials_kernel(partials_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_previous(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(partials_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


SUM_CHUNK = tl.constexpr(16)   # partials in flight at once in `sum_slices_in_last`


@triton.jit
def sum_slices_in_last(partials_ptr, y_ptr, tickets_ptr, tile, partial_offs, y_offs, mask, stride_slice):
    """Called by every K slice (grid axis 2) of a tile after storing its fp32 partial at `partial_offs`: the
    last to take the tile's ticket sums the partials in slice order (deterministic) into y and resets the
    ticket for the next call. Offsets and mask are of any tile shape, the same for every slice."""
    tl.debug_barrier()   # every thread's partial is stored before the ticket releases them
    ticket_ptr = tickets_ptr + tile
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    slices = tl.num_programs(2)
    if ticket == slices - 1:
        # read from L2 (.cg): other SMs wrote them. SUM_CHUNK loads are issued before their adds, so the
        # sum waits for L2 about slices / SUM_CHUNK times, not once per slice.
        acc = tl.zeros(partial_offs.shape, dtype=tl.float32)
        for first in range(0, slices, SUM_CHUNK):
            for j in tl.static_range(SUM_CHUNK):
                acc += tl.load(partials_ptr + (first + j) * stride_slice + partial_offs,
                               mask=mask & (first + j < slices), other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def store_row_slice(out_ptr, y_ptr, tickets_ptr, values, offs_n, mask_n, N, stride_os, stride_om,
                    FUSED_SUM: tl.constexpr):
    """A GEMV program's result (grid: rows of x, N tiles, K slices): its slice's fp32 partial of the row's
    columns `offs_n`; with FUSED_SUM the tile's last slice then sums the slices into y [M, N]."""
    row = tl.program_id(0)
    tl.store(out_ptr + tl.program_id(2) * stride_os + row * stride_om + offs_n, values.to(out_ptr.dtype.element_ty),
             mask=mask_n)
    if FUSED_SUM:   # the K slices of a tile meet here instead of in a second kernel
        sum_slices_in_last(out_ptr, y_ptr, tickets_ptr, row * tl.num_programs(1) + tl.program_id(1),
                           row * stride_om + offs_n, row * N + offs_n, mask_n, stride_os)


_tickets: dict[torch.device, torch.Tensor] = {}


def tile_tickets(device: torch.device, count: int) -> torch.Tensor | None:
    """A zeroed int32 counter per output tile for `sum_slices_in_last`, kept zero by the kernels that use it
    (None: not available while a CUDA graph is being captured, as its memory would belong to the graph)."""
    tickets = _tickets.get(device)
    if tickets is None or tickets.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            note_deferred_under_capture()
            return None
        tickets = _tickets[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return tickets


def partials_buffer(split_k: int, rows: int, cols: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[S, M, N]: y itself in `dtype` for one slice, fp32 partials for several."""
    return torch.empty(split_k, rows, cols, device=device, dtype=dtype if split_k == 1 else torch.float32)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A `partials_buffer` after the GEMM -> [M, N] in `dtype`."""
    split, rows, cols = partials.shape
    if split == 1:
        return partials[0]
    out = torch.empty(rows, cols, device=partials.device, dtype=dtype)
    numel = rows * cols
    block = 1024
    _sum_partials_kernel[(triton.cdiv(numel, block),)](partials, out, numel, SPLIT=split, BLOCK=block,
                                                        **launch_options(partials.device), num_warps=4)
    return out
