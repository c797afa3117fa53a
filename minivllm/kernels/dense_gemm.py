"""Dense GEMM for a few rows (verify steps, small batches): y = x @ w.T with x [M, K], w [N, K], bf16/fp16.

Why: at 3 to 16 rows the library (cuBLAS through F.linear) leaves its one- and two-row kernels for general
GEMM tiles that read an 8B model's weights more slowly. A verify step of k = 1..8 drafts on dummy
Llama-3-8B at batch 1 cost 1.05x to 1.21x a decode step through the library (3978b08) and 1.00x to 1.02x
for k <= 7 with this kernel (8e13116; bench/results/history/spec_*/spec_decode_verify_h100.json). On
SmolLM2-135M's small layers it changes nothing (decode graphs of 1-8 rows take 0.91-0.95 ms either way,
history/spec_8e13116/verify_step_kernels_h100.json). One program multiplies a BLOCK_M x BLOCK_K tile of
x by a BLOCK_K x BLOCK_N tile of w on the tensor cores, K split across programs when the grid would not
fill the GPU (kernels/split_k.py sums the partials). The tile and split are timed per shape against the
library path, which stays where it is faster (kernels/tuning.py).
Reference: `dense_gemm_reference` (F.linear).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels import tuning
from minivllm.kernels.split_k import choose_split_k, k_slices, num_sms, partials_buffer, split_k_tile, sum_partials

MIN_M, MAX_M = 3, 16   # rows this kernel may take; one or two rows go to the library's GEMV kernels


def dense_gemm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


@triton.jit
def _dense_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_os, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n, mask_m, mask_n, k_start, k_end = split_k_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0)
        acc = tl.dot(x, w, acc)
    out_ptrs = out_ptr + tl.program_id(2) * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


class DenseTile(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int


def candidates(M: int, N: int, K: int, device: torch.device) -> list[DenseTile | None]:
    """Tiles (None: the library GEMM), each with split-K filling the GPU about 1x, 2x and 4x."""
    out: list[DenseTile | None] = [None]
    for block_n, block_k, warps, stages in ((32, 64, 2, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 128, 4, 3)):
        for fill in (1, 2, 4):
            split = choose_split_k(M, N, K, 16, block_n, block_k, num_sms(device), fill)
            out.append(DenseTile(block_n, block_k, warps, stages, split))
    return list(dict.fromkeys(out))


def dense_gemm_triton(x: torch.Tensor, w: torch.Tensor, config: DenseTile) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    block_n, block_k, warps, stages, split_k = config
    k_per_split, split_k = k_slices(K, split_k, block_k)
    out = partials_buffer(split_k, M, N, x.device, x.dtype)
    grid = (triton.cdiv(M, 16), triton.cdiv(N, block_n), split_k)
    _dense_gemm_kernel[grid](x, w, out, M, N, K, k_per_split, x.stride(0), w.stride(0), out.stride(0), out.stride(1),
                             BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return sum_partials(out, x.dtype)


def dense_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K].T on CUDA: the faster of the Triton tiles and the library for this shape."""
    M, K = x.shape
    N = w.shape[0]
    if not MIN_M <= M <= MAX_M or x.stride(1) != 1 or w.stride(1) != 1:
        return F.linear(x, w)
    bucket = 1 << max(0, M - 1).bit_length()
    config = tuning.pick(("dense", x.dtype, bucket, N, K), candidates(bucket, N, K, x.device),
                         lambda c: F.linear(x, w) if c is None else dense_gemm_triton(x, w, c), default=None)
    return F.linear(x, w) if config is None else dense_gemm_triton(x, w, config)
