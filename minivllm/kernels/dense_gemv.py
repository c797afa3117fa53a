"""One-row dense GEMV for 16-bit weights: y = x W^T (+ b) with x a single row, as a batch-1 decode step runs every
linear layer.

A step at batch 1 is bound by how fast each weight streams from memory, and for the small matrices of MoE models'
attention and router (a few to 20 MB) cuBLAS's kernels stop short of it: they split K into a second reduction
kernel, or run too few programs to keep enough loads in flight. Here each program owns BLOCK_N output rows and
streams them whole (BLOCK_K columns per load, fp32 sums), so the grid has N / BLOCK_N programs and one kernel
does the layer. Whether it or cuBLAS runs, and with which tile, is timed per weight shape on the GPU
(`kernels/tuning.pick`, cuBLAS among the candidates), so a shape where cuBLAS is faster keeps it.

Reference: `torch.nn.functional.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels import tuning
from minivllm.kernels.pdl import launch_options, wait_for_previous

# (BLOCK_N, BLOCK_K, num_warps): one or two rows a program keep the most loads in flight. Timed on an H200 against
# cuBLAS for the attention, router and MLP shapes of Llama-3-8B, Qwen3-30B-A3B, Mixtral-8x7B and GPT-2 XL, the
# fastest tile at every shape was one of these three (`tuner_us` in bench/results/models_h200.json and
# throughput_w1_h200.json); each candidate costs start-up time to time.
GEMV_TILES = ((1, 1024, 1), (2, 2048, 2), (4, 1024, 4))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: tuple[int, int, int]) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a [1, K] row (or [K]) with the given tile."""
    block_n, block_k, warps = tile
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x.contiguous(), weight, weight if bias is None else bias, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **launch_options(x.device))
    return out


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A single 16-bit row on the GPU against a row-major weight of its dtype."""
    return (x.is_cuda and x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` for one row through cuBLAS or the GEMV, whichever the tuner timed faster for this weight shape."""
    key = ("dense_gemv", x.dtype, tuple(weight.shape), bias is not None)

    def run(candidate, w):
        return F.linear(x, w, bias) if candidate is None else gemv(x, w, bias, candidate)
    tile = tuning.pick(key, (None, *GEMV_TILES), run, None, weights=(weight,))
    return F.linear(x, weight, bias) if tile is None else gemv(x, weight, bias, tile)
