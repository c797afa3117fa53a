"""A weight asked into L2 by bulk prefetches (sm_90), launched on a side stream of a CUDA graph so that it
streams while the decode step's small kernels (rotary, attention, routing) leave HBM idle.

Reference: none needed; a prefetch changes no value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import prefetch_l2

CHUNK = 16384          # bytes per bulk prefetch
PER_PROGRAM = 32       # prefetches a program issues (one warp)


@triton.jit
def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    start = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    prefetch_l2(ptr + start, tl.minimum(nbytes - start, CHUNK), start < nbytes, 1)


def prefetchable(t: torch.Tensor) -> bool:
    return t.is_cuda and t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.numel() * t.element_size()) % 16 == 0


def prefetch(t: torch.Tensor) -> None:
    """Launch bulk L2 prefetches of all of the contiguous `t` on the current stream."""
    nbytes = t.numel() * t.element_size()
    flat = t.view(-1).view(torch.uint8)
    grid = (triton.cdiv(nbytes, CHUNK * PER_PROGRAM),)
    _prefetch_kernel[grid](flat, nbytes, CHUNK=CHUNK, PER_PROGRAM=PER_PROGRAM, num_warps=1)
