"""Programmatic dependent launch (PDL) for the decode path's Triton kernels, on Hopper and later.

At batch 1 a Llama-3-8B decode step is about 500 kernels of a few microseconds each, and with ordinary launches
each one's launch, first loads and tail are paid one after another. A kernel launched with PDL may start while
the one before it still runs: its programs issue what depends on no earlier kernel (a GEMM's first weight bytes, as L2
prefetches), then `wait_for_previous` blocks until the previous kernel has finished and its writes are
visible. The rule that keeps this correct: a kernel launched with `launch_options` calls `wait_for_previous`
before it reads or writes anything another kernel touches, on every path (also before an early return), so
each kernel's completion still implies that of all kernels before it. Right after the wait it lets its own
successor launch, so the overlap is one kernel deep, and a kernel may read before its wait what the kernels two or
more back wrote: its predecessor let it launch only once past the wait for them (the few-token MoE down GEMV
loads its expert ids, routing's output, and their first weights so). CUDA graphs keep these launches as
programmatic edges.

Off (PDL=0, an ordinary launch) on CPU, under the interpreter, before sm_90, and with MINIVLLM_PDL=0 (envs.py).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minivllm import envs


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def mode(device: torch.device) -> int:
    """0: ordinary launches; 1: the next kernel launches once this one is past its wait."""
    if (not envs.MINIVLLM_PDL or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
            or not _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())):
        return 0
    return 1


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
    """Blocks until the previous kernel's writes are visible, then lets the next kernel launch."""
    if PDL > 0:
        gdc_wait()
        gdc_launch_dependents()


_WAIT = tl.constexpr("griddepcontrol.wait; // $0")
_LAUNCH_DEPENDENTS = tl.constexpr("griddepcontrol.launch_dependents; // $0")


@gluon.jit
def gluon_wait_for_previous(PDL: gl.constexpr):
    """`wait_for_previous` for Gluon kernels, which call only Gluon functions."""
    if PDL > 0:
        gl.inline_asm_elementwise(_WAIT, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(_LAUNCH_DEPENDENTS, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


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
