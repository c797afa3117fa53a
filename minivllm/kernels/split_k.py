"""The last step of a split-K GEMM: out[m, n] = sum over s of partials[s, m, n], cast to the output dtype,
in one kernel (torch's sum then cast took two, each a few microseconds at decode sizes).
Reference: `partials.sum(0).to(dtype)`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_partials_kernel(partials_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(partials_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partials [S, M, N] fp32 (contiguous) -> [M, N] in `dtype`."""
    split, rows, cols = partials.shape
    out = torch.empty(rows, cols, device=partials.device, dtype=dtype)
    numel = rows * cols
    block = 1024
    _sum_partials_kernel[(triton.cdiv(numel, block),)](partials, out, numel, SPLIT=split, BLOCK=block, num_warps=4)
    return out
