"""Programmatic dependent launch (PDL) for the decode path's Triton kernels, on Hopper and later.

At batch 1 a Llama-3-8B decode step is about 500 kernels of a few microseconds each, and each one's launch,
first loads and tail were paid one after another. A kernel launched with PDL may start while the one before
it still runs: its programs issue what depends on no earlier kernel (a GEMM's first weight bytes, as L2
prefetches), then `wait_for_previous` blocks until the previous kernel has finished and its writes are
visible. The rule that keeps this correct: a kernel launched with `launch_options` calls `wait_for_previous`
before it reads or writes anything another kernel touches, on every path (also before an early return), so
each kernel's completion still implies that of all kernels before it. Right after the wait it lets its own
successor launch, so the overlap is one kernel deep (MINIVLLM_PDL=2: before the wait, so a chain of kernels
may be resident at once, each waiting on the one before). CUDA graphs keep these launches as programmatic
edges.

Off (PDL=0, an ordinary launch) on CPU, under the interpreter, before sm_90, and with MINIVLLM_PDL=0.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def mode(device: torch.device) -> int:
    """0: ordinary launches; 1: the next kernel launches once this one is past its wait; 2: at its start."""
    setting = os.environ.get("MINIVLLM_PDL", "1")
    if setting not in ("0", "1", "2"):
        raise ValueError(f"MINIVLLM_PDL must be 0, 1 or 2, not {setting!r}")
    if (setting == "0" or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
            or not _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())):
        return 0
    return int(setting)


def rows_prefetchable(t: torch.Tensor) -> bool:
    """Whether `prefetch_l2` may read whole rows of the 2-D `t` and 16-byte multiples of them: the base, the
    row stride and the row length in bytes all 16-byte aligned."""
    row_bytes, stride_bytes = t.shape[1] * t.element_size(), t.stride(0) * t.element_size()
    return row_bytes % 16 == 0 and stride_bytes % 16 == 0 and t.data_ptr() % 16 == 0


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel that takes a `PDL: tl.constexpr` and calls `wait_for_previous(PDL)`."""
    pdl = mode(device)
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": 0}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Blocks until the previous kernel's writes are visible; the next kernel may launch after (PDL 1) or
    before (PDL 2) that."""
    if PDL == 2:
        gdc_launch_dependents()
    if PDL > 0:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, nbytes, mask, PDL: tl.constexpr):
    """Asks L2 for `nbytes` (a multiple of 16) from each 16-byte aligned address in `ptrs` where `mask`: one
    bulk prefetch per address (sm_90), no registers or shared memory used. Only with PDL, where it overlaps
    the previous kernel; an ordinary launch finds the loads themselves as early."""
    if PDL > 0:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; } // $0",
            "=r,l,r,r", [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32), nbytes.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_word_rows(qweight_ptr, k_start, k_end, N, stride_qk, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                       PDL: tl.constexpr):
    """`prefetch_l2` of a weight-only GEMV tile's first ROWS rows of packed int32 words (8 codes a word, K rows
    from k_start, below k_end), this program's columns of them: the codes depend on no earlier kernel."""
    word_rows = k_start // 8 + tl.arange(0, ROWS)
    n0 = tl.program_id(1) * BLOCK_N
    nbytes = tl.zeros_like(word_rows) + 4 * tl.minimum(BLOCK_N, N - n0)
    prefetch_l2(qweight_ptr + word_rows.to(tl.int64) * stride_qk + n0, nbytes, word_rows * 8 < k_end, PDL)


@triton.jit
def _prefetch_range(base, nbytes, PDL: tl.constexpr, PIECES: tl.constexpr):
    """This program's share of the `nbytes` bytes at `base` (16-byte aligned): the grid's programs split the
    range evenly, each in PIECES bulk prefetches (the last few bytes, under 16, are left)."""
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    piece = tl.cdiv(tl.cdiv(nbytes, programs * PIECES), 16) * 16
    start = (pid * PIECES + tl.arange(0, PIECES)).to(tl.int64) * piece
    size = (tl.minimum(nbytes - start, piece) // 16) * 16
    prefetch_l2(base.to(tl.pointer_type(tl.uint8)) + start, size, size > 0, PDL)


@triton.jit
def prefetch_next_weights(next0, bytes0, next1, bytes1, next2, bytes2, PDL: tl.constexpr):
    """Asks L2 for the next linear layer's weights (up to three tensors), split over this kernel's programs;
    called at a program's end, so the bytes cross HBM while the small kernels between the two layers run
    and find it idle (see `int4_gemm.l2_prefetch_args`)."""
    _prefetch_range(next0, bytes0, PDL, 8)
    _prefetch_range(next1, bytes1, PDL, 1)
    _prefetch_range(next2, bytes2, PDL, 1)

