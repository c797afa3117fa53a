"""The weight-only GEMM for decode-sized M (16-64 rows) with the operands swapped: y^T = W^T x^T.

A Hopper MMA takes 64 rows of its left operand per warp group and as few as 8 columns of its right one,
and the left operand may live in registers while the right one must sit in shared memory. The plain tile
(int4_gemm._weight_only_gemm_kernel) puts the 16-64 rows of x on the left and the dequantized weights on
the right, so every weight tile formed in registers makes a round trip through shared memory before the
MMA. Here a program owns a BLOCK_N x BLOCK_M tile of y^T: the weights W^T [BLOCK_N, BLOCK_K], dequantized in
registers, are the left operand and x^T (loaded by the pipeline into shared memory) the right one.

The weights are formed either in fp32 (integer-to-float conversion, zero point and scale, rounded to x's
dtype) or, with `fast_dequant` (4-bit codes, 16-bit x), two at a time in 16 bits (kernels/half_dequant.py).
The scale and zero point are one row per step (BLOCK_K divides the group). Split-K as in int4_gemm
(kernels/split_k.py). The tile and split are timed per shape (kernels/tuning.py).
Reference: int4_gemm.weight_only_gemm_reference.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minivllm.kernels.half_dequant import dequantize_pairs
from minivllm.kernels.split_k import k_slices, partials_buffer, split_k_tile, sum_partials


class SwapAbConfig(NamedTuple):
    """A tile of `_weight_only_gemm_swap_ab_kernel` (BLOCK_K dividing the group size; `fast_dequant`:
    4-bit codes and 16-bit x)."""
    block_n: int
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int
    fast_dequant: bool = True


@triton.jit
def _weight_only_gemm_swap_ab_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K, group_size,
                                     k_per_split, stride_xm, stride_qk, stride_sg, stride_os, stride_om,
                                     BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                                     BLOCK_K: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr):
    offs_m, offs_n, mask_m, mask_n, k_start, k_end = split_k_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    PACK: tl.constexpr = 32 // BITS
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_t = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                      mask=mask_m[None, :] & (offs_k[:, None] < k_end), other=0.0)
        offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
        packed = tl.load(qweight_ptr + offs_w[None, :] * stride_qk + offs_n[:, None],
                         mask=mask_n[:, None] & (offs_w[None, :] * PACK < k_end), other=0)
        shifted = tl.reshape(packed[:, :, None] >> (tl.arange(0, PACK) * BITS)[None, None, :], (BLOCK_N, BLOCK_K))
        group = k0 // group_size
        scale = tl.load(scales_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        # x_t is zero beyond k_end: the weights there need no mask
        if FAST:
            w_t = dequantize_pairs(shifted, scale.to(x_t.dtype)[:, None], (-zero * scale).to(x_t.dtype)[:, None], ASM)
        else:
            q = (shifted & ((1 << BITS) - 1)).to(tl.float32)
            w_t = ((q - zero[:, None]) * scale[:, None]).to(x_t.dtype)
        acc += tl.dot(w_t, x_t, out_dtype=tl.float32)
    out_ptrs = out_ptr + tl.program_id(2) * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])


def swap_ab_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bits: int, config: SwapAbConfig, split_k: int) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype with one `SwapAbConfig` tile and `split_k` K slices."""
    M, K = x.shape
    N = qweight.shape[1]
    if group_size % config.block_k:
        raise ValueError(f"{config} needs a group size ({group_size}) that its BLOCK_K divides")
    if config.fast_dequant and (bits != 4 or x.element_size() != 2):
        raise ValueError(f"{config} needs 4-bit codes and 16-bit activations")
    k_per_split, split_k = k_slices(K, split_k, config.block_k)
    out = partials_buffer(split_k, M, N, x.device, x.dtype)
    grid = (triton.cdiv(M, config.block_m), triton.cdiv(N, config.block_n), split_k)
    _weight_only_gemm_swap_ab_kernel[grid](
        x, qweight, scales, zeros, out, M, N, K, group_size, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        BITS=bits, BLOCK_N=config.block_n, BLOCK_M=config.block_m, BLOCK_K=config.block_k,
        FAST=config.fast_dequant, ASM=os.environ.get("TRITON_INTERPRET") != "1", num_warps=config.num_warps,
        num_stages=config.num_stages)
    return sum_partials(out, x.dtype)
