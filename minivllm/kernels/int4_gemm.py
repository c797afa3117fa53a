"""Mixed-precision GEMM for weight-only integer formats: y = x @ dequant(W), W packed in int32 words.

Layout (see quantization/packing.py): qweight [K / pf, N] packed along K, scales and zeros [G, N].
Each program owns a BLOCK_M x BLOCK_N tile of y; per BLOCK_K step it loads the packed words of the
tile once per input row they hold (the repeats hit L1), shifts and masks out the codes, forms
(code - zero) * scale in fp32 in registers, casts to x's dtype and feeds tl.dot (bf16 MMA on Hopper):
the weights cross HBM at `bits` per value, never expanded in memory. For M <= 16 (decode) the tile
grid alone is too small to fill the GPU, so a split-K variant gives each program a K slice and writes
fp32 partials [SPLIT_K, M, N] that are summed after (deterministic, no atomics).
The reference is `weight_only_gemm_reference` (dequantize in fp32, then matmul).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.quantization.packing import weight_only_gemm_reference  # noqa: F401  (the reference)


@triton.jit
def _weight_only_gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr,
                             M, N, K, group_size, k_per_split,
                             stride_xm, stride_qk, stride_sg, stride_os, stride_om,
                             BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
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
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        packed = tl.load(qweight_ptr + (offs_k[:, None] // PACK) * stride_qk + offs_n[None, :], mask=w_mask, other=0)
        codes = (packed >> ((offs_k[:, None] % PACK) * BITS)) & ((1 << BITS) - 1)
        group = offs_k // group_size
        scale = tl.load(scales_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=w_mask, other=0.0)
        zero = tl.load(zeros_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=w_mask, other=0.0)
        w = ((codes.to(tl.float32) - zero.to(tl.float32)) * scale.to(tl.float32)).to(x.dtype)
        acc += tl.dot(x, w, out_dtype=tl.float32)
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


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


def weight_only_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bits: int = 4, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) -> [M, N] in x's dtype."""
    M, K = x.shape
    N = qweight.shape[1]
    x = x.contiguous()
    if M <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = 64, 128, 64, 4, 3
    if x.element_size() == 4:   # fp32 tiles at these sizes overflow the H100's 227 KiB of shared memory
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
        BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out[0] if split_k == 1 else out.sum(0).to(x.dtype)
