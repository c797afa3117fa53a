"""Mixed-precision GEMM for weight-only integer formats: y = x @ dequant(W), W packed in int32 words.

Layout (see quantization/packing.py): qweight [K / pf, N] packed along K, scales and zeros [G, N].
Each program owns a BLOCK_M x BLOCK_N tile of y. Per BLOCK_K step it loads the tile's packed words once,
splits each word into its pf codes with shifts (a [BLOCK_K / pf, pf, BLOCK_N] view reshaped to
[BLOCK_K, BLOCK_N]), forms (code - zero) * scale in fp32 in registers and feeds tl.dot (bf16 MMA on
Hopper): the weights cross HBM at `bits` per value, never expanded in memory. When the group size is a
multiple of BLOCK_K a step lies inside one group, and its scales and zeros are one row of N values
instead of one per weight. One-row inputs skip the MMA (a 16-row tile would be 15/16 padding): the
products are summed over K in fp32. For small M the tile grid alone is too small to fill the GPU, so a
split-K variant gives each program a K slice and writes fp32 partials [SPLIT_K, M, N] that are summed
after (deterministic, no atomics).
For large M the GEMM is compute-bound and a bf16 tensor-core matmul beats in-register dequantization:
`dequantize` expands W once into a bf16 scratch buffer (a few % of the matmul's time) and cuBLAS runs it.
The reference is `weight_only_gemm_reference` (dequantize in fp32, then matmul).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minivllm.quantization.packing import weight_only_gemm_reference  # noqa: F401  (the reference)


@triton.jit
def _unpack_tile(qweight_ptr, scales_ptr, zeros_ptr, k0, k_end, offs_n, mask_n, group_size, stride_qk, stride_sg,
                 BITS: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_PER_TILE: tl.constexpr):
    """The fp32 weights W[k0:k0 + BLOCK_K, offs_n] (zero beyond k_end)."""
    PACK: tl.constexpr = 32 // BITS
    offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    packed = tl.load(qweight_ptr + offs_w[:, None] * stride_qk + offs_n[None, :],
                     mask=(offs_w[:, None] * PACK < k_end) & mask_n[None, :], other=0)
    shifts = tl.arange(0, PACK) * BITS
    codes = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, (BLOCK_K, offs_n.shape[0])).to(tl.float32)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if GROUP_PER_TILE:
        group = k0 // group_size
        scale = tl.load(scales_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = (codes - zero[None, :]) * scale[None, :]
    else:
        group = offs_k // group_size
        w_mask = (offs_k[:, None] < k_end) & mask_n[None, :]
        scale = tl.load(scales_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=w_mask, other=0.0)
        zero = tl.load(zeros_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=w_mask, other=0.0)
        w = (codes - zero.to(tl.float32)) * scale.to(tl.float32)
    return tl.where(offs_k[:, None] < k_end, w, 0.0)


@triton.jit
def _weight_only_gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr,
                             M, N, K, group_size, k_per_split,
                             stride_xm, stride_qk, stride_sg, stride_os, stride_om,
                             BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_PER_TILE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k[None, :] < k_end), other=0.0)
        w = _unpack_tile(qweight_ptr, scales_ptr, zeros_ptr, k0, k_end, offs_n, mask_n, group_size, stride_qk,
                         stride_sg, BITS, BLOCK_K, GROUP_PER_TILE)
        if BLOCK_M == 1:
            acc += tl.sum(tl.reshape(x.to(tl.float32), (BLOCK_K, 1)) * w, axis=0)[None, :]
        else:
            acc += tl.dot(x, w.to(x.dtype), out_dtype=tl.float32)
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dequantize_kernel(qweight_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, group_size, stride_qk, stride_sg,
                       stride_ok, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_PER_TILE: tl.constexpr):
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w = _unpack_tile(qweight_ptr, scales_ptr, zeros_ptr, k0, K, offs_n, mask_n, group_size, stride_qk, stride_sg,
                     BITS, BLOCK_K, GROUP_PER_TILE)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(offs_k[:, None] < K) & mask_n[None, :])


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Tile shapes by M; chosen from the H100 sweep in bench/quant_bench.py --sweep-int4.
SMALL_M = GemmConfig(16, 64, 128, 4, 3)
ONE_ROW = GemmConfig(1, 64, 128, 4, 3)
LARGE_M = GemmConfig(64, 128, 64, 4, 3)
DEQUANTIZE_FROM_M = 128   # from this many rows on: dequantize + cuBLAS


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_split_k(M: int, N: int, K: int, block_n: int, block_k: int, num_sms: int) -> int:
    """Split K only for small M, until the grid has about two programs per SM."""
    if M > 16:
        return 1
    tiles = triton.cdiv(N, block_n)
    split = 1
    while tiles * split < 2 * num_sms and K // (split * 2) >= 2 * block_k:
        split *= 2
    return split


def default_config(M: int) -> GemmConfig:
    return ONE_ROW if M == 1 else SMALL_M if M <= 16 else LARGE_M


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bits: int,
               in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """W [K, N] in `dtype` (the reference's fp32 values, rounded once)."""
    N = qweight.shape[1]
    out = torch.empty(in_features, N, device=qweight.device, dtype=dtype)
    block_k = 64 if group_size % 64 == 0 else 32
    block_n = 128
    grid = (triton.cdiv(in_features, block_k), triton.cdiv(N, block_n))
    _dequantize_kernel[grid](qweight, scales, zeros, out, N, in_features, group_size, qweight.stride(0),
                             scales.stride(0), out.stride(0), BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k,
                             GROUP_PER_TILE=group_size % block_k == 0, num_warps=4)
    return out


def weight_only_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bits: int = 4, split_k: int | None = None,
                     config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) -> [M, N] in x's dtype."""
    M, K = x.shape
    N = qweight.shape[1]
    x = x.contiguous()
    if config is None and M >= DEQUANTIZE_FROM_M:
        return x @ dequantize(qweight, scales, zeros, group_size, bits, K, x.dtype)
    block_m, block_n, block_k, warps, stages = config or default_config(M)
    if x.element_size() == 4 and block_m > 1:   # fp32 tiles at these sizes overflow the H100's shared memory
        block_k //= 2
    if split_k is None:
        split_k = choose_split_k(M, N, K, block_n, block_k, _num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    if split_k == 1:
        out = torch.empty(1, M, N, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(split_k, M, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split_k)
    _weight_only_gemm_kernel[grid](
        x, qweight, scales, zeros, out, M, N, K, group_size, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_PER_TILE=group_size % block_k == 0,
        num_warps=warps, num_stages=stages)
    return out[0] if split_k == 1 else out.sum(0).to(x.dtype)
