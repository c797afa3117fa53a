"""Mixed-precision GEMM for weight-only integer formats: y = x @ dequant(W), W packed in int32 words.

Layout (quantization/packing.py packs it): qweight [K / pf, N] packed along K, scales and zeros [G, N].
Each program owns a BLOCK_M x BLOCK_N tile of y. Per BLOCK_K step it loads the tile's packed words once,
splits each word into its pf codes with shifts (a [BLOCK_K / pf, pf, BLOCK_N] view reshaped to
[BLOCK_K, BLOCK_N]), forms (code - zero) * scale in fp32 in registers and feeds tl.dot (bf16 MMA on
Hopper): the weights cross HBM at `bits` per value, never expanded in memory. When the group size is a
multiple of BLOCK_K a step lies inside one group, and its scales and zeros are one row of N values
instead of one per weight. One-row inputs skip the MMA (a 16-row tile would be 15/16 padding): products
accumulate elementwise in a [BLOCK_K, BLOCK_N] fp32 tile, reduced over K once at the end (a reduction
per step cost more than the loads it waited on). For small M the tile grid alone is too small to fill
the GPU, so a split-K variant gives each program a K slice and writes fp32 partials [SPLIT_K, M, N] that
are summed after in one kernel (kernels/split_k.py; deterministic). For 4-bit codes and 16-bit x the MMA
tiles form the weights two at a time in 16 bits (`fast_dequant`, kernels/half_dequant.py) instead of per
weight in fp32: the conversions, not the bytes, bound tiles that form them in fp32 (H100, 8B shapes, M = 64:
19-24% of the copy bandwidth, against 22-32% in 16 bits). Swapping the operands (y^T = W^T x^T, the weights as the MMA's register
operand, no shared-memory round trip) is slower at every 8B shape on the H100. The tile and split are timed per
shape (kernels/tuning.py).
For 4-bit codes and M <= 4, `_int4_gemv_kernel` is a candidate too, and the one chosen on the H100 at
M = 1: the per-weight int-to-float conversion (a quarter-rate instruction) and the per-weight zero and
scale bound the tile above to 0.65-1.09 TB/s; it reads a code as a float through the mantissa of 1.0
(a shift per two codes, one LOP3, one FMA per weight) and applies zero and scale once per group, and may
sum its split-K partials in the tile's last program instead of a second kernel. Its packed-half twin
(kernels/int4_gemv_half.py, two weights an instruction) is timed beside it for 16-bit x, and at one row on
Hopper so is the Gluon GEMV (kernels/int4_gemv_tma.py: weights streamed by TMA from before the PDL wait, whole K
per tile, no split-K).
For large M the GEMM is compute-bound and a bf16 tensor-core matmul beats in-register dequantization:
`dequantize_triton` expands W once into a bf16 scratch buffer (a few % of the matmul's time) and cuBLAS runs it.
The reference is `weight_only_gemm_reference` (`dequantize` in fp32, then matmul), defined here with the
layout's unpacking.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minivllm.kernels import tuning
from minivllm.kernels.half_dequant import dequantize_pairs
from minivllm.kernels.int4_gemv_half import int4_gemv_half_kernel
from minivllm.kernels.int4_gemv_tma import GROUP_SIZES as TMA_GEMV_GROUP_SIZES
from minivllm.kernels.int4_gemv_tma import TMA_GEMV_TILES, Rotary, TmaGemvConfig, int4_gemv_tma, layout_split
from minivllm.kernels.int4_gemv_tma import supported as tma_gemv_supported
from minivllm.kernels.pdl import launch_options, prefetch_word_rows, rows_prefetchable, wait_for_previous
from minivllm.kernels.rmsnorm import RowNorm
from minivllm.kernels.split_k import (choose_split_k, k_slices, num_sms, partials_buffer, split_k_tile,
                                     store_row_slice, sum_partials, tile_tickets)


# ---- the layout and the plain-PyTorch reference ------------------------------------------------------------
def pack_factor(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"unsupported bit width {bits} (2, 4 or 8)")
    return 32 // bits


def field_shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(pack_factor(bits), dtype=torch.int32, device=device) * bits


def unpack_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 [R / pf, N] -> codes int32 [rows, N] (field i of word row j is row j * pf + i)."""
    fields = (packed.unsqueeze(1) >> field_shifts(bits, packed.device).view(1, -1, 1)) & ((1 << bits) - 1)
    return fields.reshape(-1, packed.shape[1])[:rows]


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               bits: int, in_features: int) -> torch.Tensor:
    """W [K, N] in fp32 from our layout."""
    codes = unpack_rows(qweight, bits, in_features).float()
    group = torch.arange(in_features, device=qweight.device) // group_size
    return (codes - zeros.float()[group]) * scales.float()[group]


def weight_only_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                               zeros: torch.Tensor, group_size: int, bits: int = 4) -> torch.Tensor:
    """x [M, K] @ dequantized W [K, N]: weights formed in fp32, then the product in x's dtype."""
    w = dequantize(qweight, scales, zeros, group_size, bits, x.shape[-1])
    return x @ w.to(x.dtype)


# ---- the Triton kernels -------------------------------------------------------------------------------------


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
def _unpack_tile_half(qweight_ptr, scales_ptr, zeros_ptr, k0, k_end, offs_n, mask_n, group_size, stride_qk,
                      stride_sg, dtype: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """W[k0:k0 + BLOCK_K, offs_n] of 4-bit codes in `dtype` (16-bit), two at a time (kernels/half_dequant.py);
    the step lies inside one group. Rows beyond k_end hold finite values: the caller's x is zero there."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(qweight_ptr + offs_w[:, None] * stride_qk + offs_n[None, :],
                     mask=(offs_w[:, None] * 8 < k_end) & mask_n[None, :], other=0)
    shifted = tl.reshape(packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None], (BLOCK_K, offs_n.shape[0]))
    group = k0 // group_size
    scale = tl.load(scales_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    zero = tl.load(zeros_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    return dequantize_pairs(shifted, scale.to(dtype)[None, :], (-zero * scale).to(dtype)[None, :], ASM)


@triton.jit
def _weight_only_gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr,
                             M, N, K, group_size, k_per_split,
                             stride_xm, stride_qk, stride_sg, stride_os, stride_om,
                             BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_PER_TILE: tl.constexpr, FAST: tl.constexpr,
                             ASM: tl.constexpr, PDL: tl.constexpr):
    offs_m, offs_n, mask_m, mask_n, k_start, k_end = split_k_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    wait_for_previous(PDL)
    if BLOCK_M == 1:
        # One row: products summed elementwise over the K steps, reduced across K once at the end.
        partial = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tl.program_id(0) * stride_xm + offs_k, mask=offs_k < k_end, other=0.0).to(tl.float32)
            w = _unpack_tile(qweight_ptr, scales_ptr, zeros_ptr, k0, k_end, offs_n, mask_n, group_size, stride_qk,
                             stride_sg, BITS, BLOCK_K, GROUP_PER_TILE)
            partial += x[:, None] * w
        acc = tl.sum(partial, axis=0)[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & (offs_k[None, :] < k_end), other=0.0)
            if FAST:
                w = _unpack_tile_half(qweight_ptr, scales_ptr, zeros_ptr, k0, k_end, offs_n, mask_n, group_size,
                                      stride_qk, stride_sg, x.dtype, BLOCK_K, ASM)
            else:
                w = _unpack_tile(qweight_ptr, scales_ptr, zeros_ptr, k0, k_end, offs_n, mask_n, group_size,
                                 stride_qk, stride_sg, BITS, BLOCK_K, GROUP_PER_TILE).to(x.dtype)
            acc += tl.dot(x, w, out_dtype=tl.float32)
    out_ptrs = out_ptr + tl.program_id(2) * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _mantissa_field(moved, MASK: tl.constexpr, BASE: tl.constexpr, ASM: tl.constexpr):
    """The bits of `moved` under MASK in the mantissa of the float whose bits are BASE (a power of two), as a
    float: (moved & MASK) | BASE in one LOP3 (the compiler emits two logic ops for two immediates); plain
    ops under the interpreter."""
    if ASM:
        return tl.inline_asm_elementwise(f"lop3.b32 $0, $1, {MASK}, {BASE}, 0xEA;", "=r,r", [moved],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return ((moved & MASK) | BASE).to(tl.float32, bitcast=True)


@triton.jit
def _nibble_pair(words, SHIFT: tl.constexpr, ASM: tl.constexpr):
    """Word fields 2j and 2j + 1 (SHIFT = 15 - 8j moves them to bits 15-18 and 19-22) as the floats
    16 + code / 16 (in 16.0's mantissa) and 1 + code / 16 (in 1.0's): exact, one logic op per weight and a
    shift per two."""
    if SHIFT > 0:
        moved = words << SHIFT
    else:
        moved = words >> -SHIFT   # arithmetic shift: the bits it drags in are masked off
    return _mantissa_field(moved, 0x00078000, 0x41800000, ASM), _mantissa_field(moved, 0x00780000, 0x3F800000, ASM)


@triton.jit
def _x_pair(x_row, offs_w, j: tl.constexpr, k_end, X_WORDS: tl.constexpr, EVEN: tl.constexpr):
    """x at fields 2j and 2j + 1 of the word rows, in fp32.
    X_WORDS: bf16 x read as 32-bit words, a pair per load (a bf16 is the top half of its fp32), which the
    loop's pipeline can copy ahead like the codes; 16-bit loads it cannot."""
    k_low = offs_w * 8 + 2 * j
    if X_WORDS:
        if EVEN:
            word = tl.load(x_row.to(tl.pointer_type(tl.int32)) + k_low // 2)
        else:
            word = tl.load(x_row.to(tl.pointer_type(tl.int32)) + k_low // 2, mask=k_low < k_end, other=0)
        low = (word << 16).to(tl.float32, bitcast=True)
        high = (word & -65536).to(tl.float32, bitcast=True)
    else:
        low = tl.load(x_row + k_low, mask=k_low < k_end, other=0.0).to(tl.float32)
        high = tl.load(x_row + k_low + 1, mask=k_low + 1 < k_end, other=0.0).to(tl.float32)
    return low, high


@triton.jit
def _int4_gemv_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, y_ptr, tickets_ptr, N, K, group_size,
                      k_per_split, stride_xm, stride_qk, stride_sg, stride_os, stride_om,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, FUSED_SUM: tl.constexpr,
                      X_WORDS: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr, PREFETCH_WORDS: tl.constexpr,
                      PDL: tl.constexpr):
    """One row of x per program (grid: rows, N tiles, K slices); 4-bit fields, BLOCK_K dividing the group.

    Per weight: a shift per two fields, one mask-and-or into a float's mantissa (`_nibble_pair`) and one
    FMA; the zero point and the scale are applied once per K step and column. With f = 1 + q / 16 for odd
    fields and f = 16 + q / 16 for even ones, every product is x q / 16 plus x or 16 x; the step's sum minus
    those terms is acc = sum x q / 16, and y += 16 s acc - s z sum x. The K loop is pipelined STAGES deep
    (`tl.range`): without a dot in the loop Triton's pipeliner leaves a plain `range` alone, and each step
    waited for its own loads."""
    _, offs_n, _, mask_n, k_start, k_end = split_k_tile(1, N, K, k_per_split, 1, BLOCK_N)
    WORDS: tl.constexpr = BLOCK_K // 8
    if PREFETCH_WORDS > 0:   # the first word rows load while the previous kernel runs
        prefetch_word_rows(qweight_ptr, k_start, k_end, N, stride_qk, BLOCK_N, PREFETCH_WORDS, PDL)
    wait_for_previous(PDL)
    x_row = x_ptr + tl.program_id(0) * stride_xm
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        offs_w = k0 // 8 + tl.arange(0, WORDS)
        if EVEN:
            words = tl.load(qweight_ptr + offs_w[:, None] * stride_qk + offs_n[None, :])
        else:
            words = tl.load(qweight_ptr + offs_w[:, None] * stride_qk + offs_n[None, :],
                            mask=(offs_w[:, None] * 8 < k_end) & mask_n[None, :], other=0)
        x_even = tl.zeros((WORDS,), dtype=tl.float32)   # sums of x at the even and the odd fields
        x_odd = tl.zeros((WORDS,), dtype=tl.float32)
        acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(4):
            x_low, x_high = _x_pair(x_row, offs_w, j, k_end, X_WORDS, EVEN)
            f_low, f_high = _nibble_pair(words, 15 - 8 * j, ASM)
            acc += x_low[:, None] * f_low
            acc += x_high[:, None] * f_high
            x_even += x_low
            x_odd += x_high
        # the step's word rows summed before the group's scale and zero: once per column, not per word
        # (a thread holds all rows of its columns when BLOCK_N >= 128 x num_warps)
        even, odd = tl.sum(x_even, axis=0), tl.sum(x_odd, axis=0)
        x_sum = even + odd
        column = tl.sum(acc, axis=0) - (16.0 * even + odd)   # minus the q-independent part of the products
        group = k0 // group_size
        scale = tl.load(scales_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        total += (16.0 * scale) * column - (scale * zero) * x_sum
    store_row_slice(out_ptr, y_ptr, tickets_ptr, total, offs_n, mask_n, N, stride_os, stride_om, FUSED_SUM)


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
    """A tile of `_weight_only_gemm_kernel`; fast_dequant: weights formed two at a time in 16 bits
    (kernels/half_dequant.py: 4-bit codes, 16-bit x, BLOCK_K dividing the group size, BLOCK_M > 1)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    fast_dequant: bool = False


class GemvConfig(NamedTuple):
    """A tile of `_int4_gemv_kernel` (4-bit, BLOCK_K dividing the group size; a program per row of x);
    fused_sum: split-K partials summed by the tile's last slice, not by a second kernel; half: the kernel in
    packed-half arithmetic (kernels/int4_gemv_half.py; 16-bit x)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    fused_sum: bool = False
    half: bool = False


DEQUANTIZE_FROM_M = 128   # from this many rows on: dequantize + cuBLAS (compute-bound; H100 sweep)


def default_config(M: int) -> GemmConfig:
    return GemmConfig(1, 128, 64, 4, 4) if M == 1 else GemmConfig(16, 128, 64, 4, 4) if M <= 16 \
        else GemmConfig(64, 32, 128, 4, 4)


# the best tiles of the pipelined kernel on the 8B shapes at M = 1 (H100, bench/kernels/int4_gemv_sweep.py), each
# with the split-K sum fused, and three with it in a second kernel
_BEST_GEMV = ((256, 64, 2, 4), (1024, 64, 4, 3), (512, 64, 2, 3), (512, 128, 4, 2), (512, 32, 2, 4), (256, 128, 2, 3))
GEMV_TILES = tuple(GemvConfig(*t, fused_sum=True) for t in _BEST_GEMV) + tuple(GemvConfig(*t) for t in _BEST_GEMV[:3])
# the packed-half kernel's candidates (fewer instructions per weight: wider tiles per thread pay for x's pairs)
HALF_GEMV_TILES = tuple(GemvConfig(*t, fused_sum=True, half=True) for t in
                        ((512, 64, 2, 3), (1024, 64, 4, 3), (1024, 32, 2, 3), (1024, 64, 2, 3), (512, 64, 2, 4),
                         (512, 32, 1, 3), (256, 64, 1, 3), (2048, 32, 4, 3)))
GEMV_MAX_M = 4   # a program per row re-reads the weights (from L2): the MMA tiles win beyond a few rows


def gemv_tiles(M: int, group_size: int, bits: int, dtype: torch.dtype = torch.bfloat16) -> list[GemvConfig]:
    if bits != 4 or M > GEMV_MAX_M:
        return []
    tiles = GEMV_TILES + (HALF_GEMV_TILES if dtype in (torch.bfloat16, torch.float16) else ())
    return [t for t in tiles if group_size % t.block_k == 0]


def tma_gemv_tiles(M: int, group_size: int, bits: int, dtype: torch.dtype, device: torch.device) -> list[TmaGemvConfig]:
    """The Gluon GEMV's candidates (one row of 16-bit x on CUDA); whether the GPU is an sm_90 one is checked at
    the call."""
    if (bits != 4 or M != 1 or dtype not in (torch.bfloat16, torch.float16) or device.type != "cuda"
            or group_size not in TMA_GEMV_GROUP_SIZES):
        return []
    return [t for t in TMA_GEMV_TILES if layout_split(t, group_size // 8) is not None]


FAST_SMALL = (GemmConfig(16, 128, 64, 4, 3, True), GemmConfig(16, 64, 128, 4, 3, True),
              GemmConfig(16, 256, 64, 4, 3, True), GemmConfig(16, 256, 128, 4, 3, True))
FAST_MEDIUM = (GemmConfig(64, 128, 128, 4, 3, True), GemmConfig(64, 256, 64, 4, 4, True),
               GemmConfig(64, 64, 128, 4, 3, True), GemmConfig(64, 128, 64, 4, 3, True),
               GemmConfig(64, 256, 128, 8, 3, True), GemmConfig(32, 128, 128, 4, 3, True))


def candidates(M: int, N: int, K: int, device: torch.device, group_size: int = 128, bits: int = 4,
               dtype: torch.dtype = torch.bfloat16) -> list[tuple[GemmConfig | GemvConfig, int] | None]:
    """(tile, split) pairs to time for M rows of `dtype` (None: dequantize + cuBLAS); tiles from the H100
    sweeps (bench/kernels/int4_gemv_sweep.py, bench/kernels/int4_w1_sweep.py)."""
    one_row = [GemmConfig(1, 128, 64, 4, 4), GemmConfig(1, 128, 64, 4, 2), GemmConfig(1, 64, 128, 4, 4),
               GemmConfig(1, 256, 64, 8, 4), GemmConfig(1, 128, 128, 8, 3)]
    small = [GemmConfig(16, 128, 64, 4, 4), GemmConfig(16, 128, 64, 4, 2), GemmConfig(16, 64, 128, 4, 4),
             GemmConfig(16, 256, 64, 8, 3)]
    medium = [GemmConfig(64, 32, 128, 4, 4), GemmConfig(64, 128, 64, 4, 4), GemmConfig(64, 64, 128, 4, 4),
              GemmConfig(32, 64, 128, 4, 4)]
    if bits == 4 and dtype in (torch.bfloat16, torch.float16):
        # 16-bit weights formed two at a time beat the fp32 ones on every 8B shape at M = 16 and 64 (H100,
        # bench/kernels/int4_w1_sweep.py: one layer 115.9 / 145.2 us against 144.8 / 196.8): the best of 48 tiles
        small_fast = [t for t in FAST_SMALL if group_size % t.block_k == 0]
        medium_fast = [t for t in FAST_MEDIUM if group_size % t.block_k == 0]
        small, medium = small_fast or small, medium_fast or medium
    tiles = one_row if M == 1 else small + one_row[:1] if M <= 4 else small if M <= 16 else medium
    out: list[tuple[GemmConfig | GemvConfig, int] | None] = [None]
    for tile in tiles:
        for fill in ((2, 4) if M <= 16 else (1, 2)):
            out.append((tile, choose_split_k(M, N, K, tile.block_m, tile.block_n, tile.block_k, num_sms(device),
                                             fill)))
    for tile in gemv_tiles(M, group_size, bits, dtype):
        for fill in (2, 4, 8):
            out.append((tile, choose_split_k(M, N, K, 1, tile.block_n, tile.block_k, num_sms(device), fill)))
    tma = [(tile, 1) for tile in tma_gemv_tiles(M, group_size, bits, dtype, device)]
    return list(dict.fromkeys(out + tma))


def dequantize_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bits: int,
                      in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """W [K, N] in `dtype` in one kernel (the reference `dequantize`'s fp32 values, rounded once)."""
    N = qweight.shape[1]
    out = torch.empty(in_features, N, device=qweight.device, dtype=dtype)
    block_k = 64 if group_size % 64 == 0 else 32
    block_n = 128
    grid = (triton.cdiv(in_features, block_k), triton.cdiv(N, block_n))
    _dequantize_kernel[grid](qweight, scales, zeros, out, N, in_features, group_size, qweight.stride(0),
                             scales.stride(0), out.stride(0), BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k,
                             GROUP_PER_TILE=group_size % block_k == 0, num_warps=4)
    return out


def _triton_gemm(x, qweight, scales, zeros, group_size, bits, config: GemmConfig | GemvConfig | TmaGemvConfig,
                 split_k: int, zero_point: int | None = None) -> torch.Tensor:
    M, K = x.shape
    N = qweight.shape[1]
    if isinstance(config, TmaGemvConfig):
        if bits != 4 or not tma_gemv_supported(x, qweight, scales, zeros, group_size):
            raise ValueError(f"{config} needs 4-bit codes, one row of 16-bit x on an sm_90 GPU, a group size in "
                             f"{TMA_GEMV_GROUP_SIZES} and 16-byte aligned weight rows")
        return int4_gemv_tma(x, qweight, scales, zeros, group_size, config, zero_point=zero_point)
    if isinstance(config, GemvConfig):
        return _gemv(x, qweight, scales, zeros, group_size, bits, config, split_k)
    block_m, block_n, block_k, warps, stages, fast = config
    if fast and (bits != 4 or x.element_size() != 2 or group_size % block_k or block_m == 1):
        raise ValueError(f"{config} needs 4-bit codes, 16-bit x, a group size its BLOCK_K divides and BLOCK_M > 1")
    if x.element_size() == 4 and block_m > 1:   # fp32 tiles at these sizes overflow the H100's shared memory
        block_k //= 2
    k_per_split, split_k = k_slices(K, split_k, block_k)
    out = partials_buffer(split_k, M, N, x.device, x.dtype)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split_k)
    _weight_only_gemm_kernel[grid](
        x, qweight, scales, zeros, out, M, N, K, group_size, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_PER_TILE=group_size % block_k == 0,
        FAST=fast, ASM=os.environ.get("TRITON_INTERPRET") != "1", **launch_options(x.device), num_warps=warps,
        num_stages=stages)
    return sum_partials(out, x.dtype)


def _gemv(x, qweight, scales, zeros, group_size, bits, config: GemvConfig, split_k: int) -> torch.Tensor:
    M, K = x.shape
    N = qweight.shape[1]
    if bits != 4 or group_size % config.block_k:
        raise ValueError(f"{config} needs 4-bit codes and a group size ({group_size}) it divides")
    if config.half and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{config} needs bf16 or fp16 x, not {x.dtype}")
    k_per_split, split_k = k_slices(K, split_k, config.block_k)
    grid = (M, triton.cdiv(N, config.block_n), split_k)
    out = partials_buffer(split_k, M, N, x.device, x.dtype)
    tickets = tile_tickets(x.device, M * grid[1]) if config.fused_sum and split_k > 1 else None
    y = out if tickets is None else torch.empty(M, N, device=x.device, dtype=x.dtype)
    pdl = launch_options(x.device)
    even = N % config.block_n == 0 and K % config.block_k == 0   # every tile and K step whole: no masks
    x_words = x.dtype == torch.bfloat16 and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0
    prefetch = 2 * config.block_k // 8 if pdl["PDL"] and rows_prefetchable(qweight) else 0
    if config.half:
        if x.stride(0) % 2 or x.data_ptr() % 4:
            x = x.clone()   # read as 32-bit words: a fresh allocation is aligned (K is even: the group size is)
        int4_gemv_half_kernel[grid](
            x, qweight, scales, zeros, out, y, out if tickets is None else tickets, N, K, group_size, k_per_split,
            x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, IS_BF16=x.dtype == torch.bfloat16,
            FRACTIONAL_ZEROS=zeros.dtype == torch.float32, ASM=os.environ.get("TRITON_INTERPRET") != "1",
            FUSED_SUM=tickets is not None, EVEN=even, STAGES=config.num_stages, PREFETCH_WORDS=prefetch, **pdl,
            num_warps=config.num_warps, num_stages=config.num_stages)
        return sum_partials(out, x.dtype) if tickets is None else y
    _int4_gemv_kernel[grid](
        x, qweight, scales, zeros, out, y, out if tickets is None else tickets, N, K, group_size, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, ASM=os.environ.get("TRITON_INTERPRET") != "1",
        FUSED_SUM=tickets is not None, X_WORDS=x_words, EVEN=even, STAGES=config.num_stages,
        PREFETCH_WORDS=prefetch, **pdl, num_warps=config.num_warps, num_stages=config.num_stages)
    return sum_partials(out, x.dtype) if tickets is None else y


def _gemv_with_epilogue(x, qweight, scales, zeros, group_size, tiles, config, key, **epilogue) -> torch.Tensor | None:
    """The Gluon GEMV with `epilogue` (int4_gemv_tma's gated / rotary / norm / zero_point), on `config` or on the
    fastest of `tiles` for the tuning key `key` (timed once, cold); None where no tile serves it."""
    if config is None and not tiles:
        return None
    x = x.contiguous()

    def run(tile, qweight=qweight, scales=scales, zeros=zeros):
        return int4_gemv_tma(x, qweight, scales, zeros, group_size, tile, **epilogue)
    if config is None:
        norm = epilogue.get("norm")
        normed = "none" if norm is None else "norm" if norm.residual is None else "add and norm"
        config = tuning.pick(key + (normed,), tiles, run, tiles[0], weights=(qweight, scales, zeros))
    return run(config)


def weight_only_gemv_silu_and_mul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                                  group_size: int, bits: int = 4, config: TmaGemvConfig | None = None,
                                  norm: RowNorm | None = None, zero_point: int | None = None) -> torch.Tensor | None:
    """silu(x @ W_gate) * (x @ W_up) [1, N / 2] for W = [gate | up] (gate_up_proj's columns) from one kernel: the
    Gluon GEMV with the activation in its epilogue, which saves the activation's launch and round trip; with
    `norm`, RMSNorm(x [+ residual]) is what multiplies W (the norm's kernel saved too, rmsnorm.RowNorm). None
    where that kernel does not serve the call (not one row of 16-bit x on an sm_90 GPU, 4-bit codes, aligned
    halves); the caller then runs the norm, the GEMM and the activation. zero_point: see `weight_only_gemm`."""
    if bits != 4 or not tma_gemv_supported(x, qweight, scales, zeros, group_size, gated=True, norm=norm):
        return None
    tiles = tma_gemv_tiles(x.shape[0], group_size, bits, x.dtype, x.device)
    key = ("weight_only_silu_and_mul", x.dtype, group_size, qweight.shape[1], x.shape[1])
    return _gemv_with_epilogue(x, qweight, scales, zeros, group_size, tiles, config, key, gated=True, norm=norm,
                               zero_point=zero_point)


def weight_only_gemv_rotary(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            group_size: int, bits: int, rotary: Rotary, config: TmaGemvConfig | None = None,
                            norm: RowNorm | None = None, zero_point: int | None = None) -> torch.Tensor | None:
    """x @ W [1, N] for qkv_proj's W (heads of rotary.head_dim columns) with the first rotary.rotated_heads
    heads (q and k) rotated at rotary.positions, from one kernel (the Gluon GEMV with the rotation in its
    epilogue: the rotary kernel's launch and round trip saved); with `norm`, of RMSNorm(x [+ residual])
    (rmsnorm.RowNorm). None where that kernel does not serve the call; the caller then runs the norm, the
    GEMM and the rotary kernel. zero_point: see `weight_only_gemm`."""
    if (bits != 4 or qweight.shape[1] % rotary.head_dim
            or not tma_gemv_supported(x, qweight, scales, zeros, group_size, norm=norm)):
        return None
    tiles = [t for t in tma_gemv_tiles(x.shape[0], group_size, bits, x.dtype, x.device)
             if (rotary.head_dim // 2) % (t.block_n // 2) == 0]
    key = ("weight_only_rotary", x.dtype, group_size, qweight.shape[1], x.shape[1], rotary.head_dim)
    return _gemv_with_epilogue(x, qweight, scales, zeros, group_size, tiles, config, key, rotary=rotary, norm=norm,
                               zero_point=zero_point)


def weight_only_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bits: int = 4, split_k: int | None = None,
                     config: GemmConfig | GemvConfig | TmaGemvConfig | None = None,
                     zero_point: int | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) -> [M, N] in x's dtype. `config` / `split_k` fix the tile (tests, sweeps);
    otherwise it is timed per shape on the GPU (kernels/tuning.py). zero_point: the value of every entry of
    `zeros` where they are all one (symmetric weights); the Gluon GEMV then does not read them, the other
    kernels do."""
    M, K = x.shape
    N = qweight.shape[1]
    x = x.contiguous()
    args = (x, qweight, scales, zeros, group_size, bits)
    fixed = config is not None or split_k is not None
    if not fixed and M >= DEQUANTIZE_FROM_M:
        return x @ dequantize_triton(qweight, scales, zeros, group_size, bits, K, x.dtype)
    if fixed or not x.is_cuda:
        config = config or default_config(M)
        if split_k is None:
            split_k = 1 if isinstance(config, TmaGemvConfig) else \
                choose_split_k(M, N, K, config.block_m, config.block_n, config.block_k, num_sms(x.device))
        return _triton_gemm(*args, config, split_k, zero_point)

    def run(choice, qweight=qweight, scales=scales, zeros=zeros):
        if choice is None:
            return x @ dequantize_triton(qweight, scales, zeros, group_size, bits, K, x.dtype)
        return _triton_gemm(x, qweight, scales, zeros, group_size, bits, *choice, zero_point)
    bucket = 1 << max(0, M - 1).bit_length()
    default = (default_config(M), choose_split_k(M, N, K, *default_config(M)[:3], num_sms(x.device)))
    choice = tuning.pick(("weight_only", x.dtype, bits, group_size, bucket, N, K),
                         candidates(bucket, N, K, x.device, group_size, bits, x.dtype), run, default,
                         weights=(qweight, scales, zeros))
    return run(choice)
