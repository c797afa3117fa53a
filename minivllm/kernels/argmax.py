"""Row-wise argmax over a vocabulary-sized row, for greedy sampling.

torch.argmax reduces each row in a single thread block: one 128k-entry row of Llama-3 logits took 30 us
of an H100 batch-1 decode step (bench/profile_step.py). Here each row is cut
into chunks that separate programs reduce, then one program per row picks the best chunk, in about a tenth
of that. As torch.argmax, ties go to the lowest index; a NaN counts as +inf (torch ranks NaN above +inf,
a difference only a row holding both would show).
Reference: `torch.argmax(x, dim=-1)`, used off CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import launch_options, wait_for_previous

CHUNK = 4096


@triton.jit
def _chunk_argmax_kernel(x_ptr, best_ptr, index_ptr, V, stride_x, CHUNK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_ptr + row * tl.num_programs(1) + chunk, best)
    tl.store(index_ptr + row * tl.num_programs(1) + chunk, chunk * CHUNK + index)


@triton.jit
def _pick_chunk_kernel(best_ptr, index_ptr, out_ptr, num_chunks, V, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < num_chunks
    best = tl.load(best_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    index = tl.load(index_ptr + row * num_chunks + offs, mask=mask, other=V)
    top = tl.max(best, axis=0)
    # the lowest index among the chunks holding the maximum (every chunk does for an all -inf row)
    tl.store(out_ptr + row, tl.min(tl.where(mask & (best == top), index, V), axis=0).to(tl.int64))


def argmax_rows_triton(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> int64 [R] (CUDA, or CPU under TRITON_INTERPRET=1)."""
    rows, V = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_chunks = triton.cdiv(V, CHUNK)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    index = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        pdl = launch_options(x.device)
        _chunk_argmax_kernel[(rows, num_chunks)](x, best, index, V, x.stride(0), CHUNK=CHUNK, **pdl, num_warps=8)
        _pick_chunk_kernel[(rows,)](best, index, out, num_chunks, V, BLOCK=triton.next_power_of_2(num_chunks), **pdl,
                                    num_warps=1)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value: the kernels on CUDA, torch.argmax elsewhere."""
    if x.is_cuda and x.dim() == 2 and x.shape[1] > CHUNK:
        return argmax_rows_triton(x)
    return x.argmax(dim=-1)
