"""Fused Mixture-of-Experts MLP: every routed (token, expert) pair through its expert's SwiGLU MLP,
as two grouped GEMM launches over the stacked expert weights, with no Python loop over experts.

Expert weights are stacked: `w13` [E, 2I, H] (gate rows then up rows, like `gate_up_proj`) and
`w2` [E, H, I]. A token routed to `top_k` experts occupies `top_k` "slots" (slot = token * top_k + k).

1. `moe_sort.align_block_size` sorts the slots by expert and pads each expert's group to a multiple of
   BLOCK_M, so every BLOCK_M-row tile belongs to a single expert; padding rows hold the sentinel
   `num_slots`. Its buffers are sized by (slots, experts, BLOCK_M), so there is no host sync and the step
   stays capturable in a CUDA graph; tiles past the last group get expert -1 and exit at once (one kernel
   program up to 64 slots, a counting sort in three kernels beyond; see moe_sort.py).
   Up to `UNSORTED_MAX_SLOTS` slots the tuner also times tiles that skip it (`UNSORTED_TILES`): each expert's
   programs find their slots in the routing ids themselves and take them in the same tiles.
2. `_fused_moe_kernel` computes, per (tile, BLOCK_N columns), the tile's gathered input rows times its
   expert's weight: first hidden[slot // top_k] @ w13[e]^T -> [slots, 2I], then (after SiLU-and-mul)
   act[slot] @ w2[e]^T scaled by the routing weight -> [slots, H]; the top_k slots of each token are
   summed at the end. fp32 accumulation, one rounding to the model dtype per GEMM, like a linear layer.
   A GATED prefill tile applies SiLU-and-mul in the gate/up GEMM's epilogue instead (each program streams the
   matching gate and up rows, half of BLOCK_N each), saving the activation's pass and half the gate/up writes.

A few tokens (decode) take another path: with `top_k` slots a token and up to `GEMV_MAX_SLOTS` slots, the
sort, the padding to whole tiles and the tensor-core tiles cost more than they save, since each expert sees
one or two rows. `_moe_gate_up_gemv_kernel` reads each slot's expert id straight from `topk_ids` (no sort, no
host sync) and streams that expert's gate and up rows once, as a GEMV, with SiLU-and-mul fused; then
`_moe_down_combine_gemv_kernel` streams, per token, the down rows of all its top_k experts at once, applies the
routing weights and sums them: two kernels for the whole MoE MLP. Which path runs, and which tiles, is timed per
slot count on the GPU (`kernels/tuning.pick`, stored per device like the other kernels' tiles) on uniform random
routing, with the grouped path among the candidates, so the few-token path is only used where it measures faster.
The grouped GEMMs' tile is timed the same way, from candidates for up to 16 rows per expert (decode batches), up to
64, and beyond (prefill), where torch's grouped GEMM over rows sorted by expert (`moe_grouped_mm.py`) is a candidate
too.

8-bit experts (quantization/moe_8bit.py: fp8 or int8 codes with an fp32 scale per output row, `w13_scale`,
`w2_scale` [E, rows]) run through both paths. The grouped GEMMs run them as W8A8, as the dense 8-bit layers
do: each GEMM's input rows are quantized per row to the experts' format (the SiLU-and-mul kernel does it for
the down GEMM's), the tensor cores multiply 8-bit codes, and the sum is scaled by the row's and the column's
scales. The few-token GEMVs, bound by the weights' bytes, keep the activations: they widen each code as they
load it and scale each output row's sum.

`fused_experts_reference` is the plain-PyTorch computation (the loop over experts HF uses); the MoE
layer runs it on CPU and the tests compare the kernel against it.
"""
from __future__ import annotations

import functools
import itertools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from minivllm.kernels import tuning
from minivllm.kernels.activation import silu_and_mul, silu_and_mul_reference
from minivllm.kernels.quant_rows import quantize_rows
from minivllm.kernels.w8a8_gemm import dot_8bit
from minivllm.kernels.decode_attention import _dot, _dot_precision, _upcast_dot
from minivllm.kernels import moe_grouped_mm
from minivllm.kernels.moe_sort import align_block_size, token_slots
from minivllm.kernels.pdl import launch_options, wait_for_previous


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """8-bit expert codes [..., rows, cols] times their row scales [..., rows], in `dtype` (unchanged without
    scales)."""
    return weight if scale is None else (weight.float() * scale[..., None]).to(dtype)


def fused_experts_reference(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                            w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [M, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [M, top_k] -> [M, H], computed
    expert by expert as transformers does (so fp32 results agree to rounding); 8-bit experts dequantized."""
    out = torch.zeros_like(hidden_states)
    for expert in topk_ids.unique().tolist():
        token_idx, k_idx = torch.where(topk_ids == expert)
        x = hidden_states[token_idx]
        gate_up = dequantize_experts(w13[expert], None if w13_scale is None else w13_scale[expert], x.dtype)
        down = dequantize_experts(w2[expert], None if w2_scale is None else w2_scale[expert], x.dtype)
        y = F.linear(silu_and_mul_reference(F.linear(x, gate_up)), down)
        y = y * topk_weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


@triton.jit
def _b_tile(b_base, b_desc, row, k0, offs_k, k_mask, n_mask, stride_bk, EVEN: tl.constexpr, TMA: tl.constexpr,
            ZERO: tl.constexpr):
    """B's [BLOCK_K, BLOCK_N] tile at K step k0: through the descriptor from its row `row` of [E * rows, K] (TMA),
    or through the pointers `b_base` [1, BLOCK_N] to its columns' rows."""
    if TMA:
        b = tl.trans(b_desc.load([row, k0]))
    elif EVEN:
        b = tl.load(b_base + offs_k[:, None] * stride_bk)
    else:
        b = tl.load(b_base + offs_k[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :], other=ZERO)
    return b


@triton.jit
def _expert_tile(a_ptr, b_ptr, b_desc, c_ptr, weights_ptr, scale_ptr, a_scale_ptr, expert, slots, row_mask, pid_n,
                 N, K, stride_am, stride_be, stride_bn, stride_bk, stride_cm, stride_se,
                 ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr, SCALED: tl.constexpr, IS_INT: tl.constexpr,
                 WIDEN: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN: tl.constexpr,
                 TMA: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """C[slot, n] = sum_k A[slot // ROWS_PER_A, k] * B[expert, n, k] (* weight[slot]) for the BLOCK_M `slots` (rows
    off `row_mask` untouched) and BLOCK_N columns. EVEN: the tile divides N and K, so only rows are masked. TMA (with
    EVEN): B's tiles come through `b_desc`, a tensor descriptor over B as [E * rows, K]; A's rows through pointers.
    GATED: B has 2N rows an expert (gate, then up) and C[slot, n] = silu(gate) * up of the two products, rounded
    where the separate SiLU-and-mul kernel rounds (each product, then silu)."""
    a_rows = (slots // ROWS_PER_A).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
    if GATED:
        desc_row = expert.to(tl.int32) * (2 * N) + pid_n * BLOCK_N
    else:
        desc_row = expert.to(tl.int32) * N + pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if IS_INT else tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ZERO: tl.constexpr = 0 if IS_INT else 0.0
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a_mask = row_mask[:, None] if EVEN else row_mask[:, None] & k_mask[None, :]
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=a_mask, other=ZERO)
        b = _b_tile(b_base, b_desc, desc_row, k0, offs_k, k_mask, n_mask, stride_bk, EVEN, TMA, ZERO)
        if SCALED:
            acc += dot_8bit(a, b, IS_INT, WIDEN)
        else:
            acc += _dot(a, b, DOT_PRECISION, UPCAST)
        if GATED:   # the up rows, N rows after the gate rows
            b_up = _b_tile(b_base + N * stride_bn, b_desc, desc_row + N, k0, offs_k, k_mask, n_mask, stride_bk,
                           EVEN, TMA, ZERO)
            acc_up += _dot(a, b_up, DOT_PRECISION, UPCAST)
    if SCALED:   # the scales factor out of the sum over K
        a_scale = tl.load(a_scale_ptr + a_rows, mask=row_mask, other=0.0)
        b_scale = tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_mask, other=0.0)
        acc = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if GATED:
        dtype = c_ptr.dtype.element_ty
        gate = acc.to(dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + slots, mask=row_mask, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    c = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _grouped_order(pid_m, pid_n, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column block) of a program in GROUP_M-row-tile groups: the grid runs in launch order (dim 0
    fastest), and each group takes every column block of its GROUP_M row tiles before the next group starts, so a
    row tile's inputs and its expert's weight rows are read from HBM about once and from L2 by the rest."""
    pid = pid_n * num_m + pid_m
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first, GROUP_M)
    return first + (pid % per_group) % rows, (pid % per_group) // rows


# The slot count changes every eager step; specialising on it would recompile mid-run.
@triton.jit(do_not_specialize=["num_slots"])
def _fused_moe_kernel(a_ptr, b_ptr, b_desc, c_ptr, weights_ptr, scale_ptr, a_scale_ptr, ids_ptr, expert_ids_ptr,
                      N, K, num_slots, stride_am, stride_be, stride_bn, stride_bk, stride_cm, stride_se,
                      ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr, SCALED: tl.constexpr,
                      IS_INT: tl.constexpr, WIDEN: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr,
                      GATED: tl.constexpr, SLOTS: tl.constexpr, GROUP_M: tl.constexpr, HALF_TAIL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The grouped GEMM over (row tile, BLOCK_N columns) programs. SLOTS = 0: `ids_ptr` is the sorted, padded slot
    list and `expert_ids_ptr` each BLOCK_M-row tile's expert. SLOTS > 0 (a power of two >= num_slots): no sort;
    program row 0 is expert 0's, 1 expert 1's and so on, each finding its slots in the routing ids `ids_ptr`
    itself (a compare and a running sum over every slot) and taking them BLOCK_M at a time, in slot order: the
    same rows in the same tiles as the sorted list. GROUP_M > 1 (sorted only): programs in `_grouped_order`.
    HALF_TAIL (sorted only): a tile whose second half is padding (a group's last tile, filled from its start) is
    computed as BLOCK_M / 2 rows."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUP_M > 1:
        pid_m, pid_n = _grouped_order(pid_m, pid_n, tl.num_programs(0), tl.num_programs(1), GROUP_M)
    if SLOTS == 0:
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        tile = ids_ptr + pid_m * BLOCK_M
        if HALF_TAIL and tl.load(tile + BLOCK_M // 2) >= num_slots:
            half = tl.load(tile + tl.arange(0, BLOCK_M // 2))   # a name of its own: Triton types it per branch
            _expert_tile(a_ptr, b_ptr, b_desc, c_ptr, weights_ptr, scale_ptr, a_scale_ptr, expert, half,
                         half < num_slots, pid_n, N, K, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
                         stride_se, ROWS_PER_A, MUL_WEIGHT, SCALED, IS_INT, WIDEN, DOT_PRECISION, UPCAST, EVEN, TMA,
                         GATED, BLOCK_M // 2, BLOCK_N, BLOCK_K)
        else:
            slots = tl.load(tile + tl.arange(0, BLOCK_M))
            _expert_tile(a_ptr, b_ptr, b_desc, c_ptr, weights_ptr, scale_ptr, a_scale_ptr, expert, slots,
                         slots < num_slots, pid_n, N, K, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
                         stride_se, ROWS_PER_A, MUL_WEIGHT, SCALED, IS_INT, WIDEN, DOT_PRECISION, UPCAST, EVEN, TMA,
                         GATED, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        offs = tl.arange(0, SLOTS)
        match = (tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1) == pid_m).to(tl.int32)
        count = tl.sum(match, axis=0)
        rank = tl.where(match > 0, tl.cumsum(match, axis=0) - 1, -1)   # each of the expert's slots' place
        rows = tl.arange(0, BLOCK_M)
        for first in range(0, count, BLOCK_M):
            slots = tl.sum(tl.where(rank[None, :] == first + rows[:, None], offs[None, :], 0), axis=1)
            _expert_tile(a_ptr, b_ptr, b_desc, c_ptr, weights_ptr, scale_ptr, a_scale_ptr, pid_m.to(tl.int64),
                         slots, first + rows < count, pid_n, N, K, stride_am, stride_be, stride_bn, stride_bk,
                         stride_cm, stride_se, ROWS_PER_A, MUL_WEIGHT, SCALED, IS_INT, WIDEN, DOT_PRECISION,
                         UPCAST, EVEN, TMA, GATED, BLOCK_M, BLOCK_N, BLOCK_K)


# Tiles timed per shape and slot bucket (`kernels/tuning.pick`) while each expert sees up to 16 rows (decode
# batches: 64 tokens of top-8 routing over 128 experts give each about 4) and up to 64. There the GEMMs stream every
# touched expert's weights once and are bound by the loads in flight, so the candidates vary the columns and the
# depth of K a program streams and the pipeline's stages; the first of each is the default where timing can't run.
FEW_ROW_TILES = (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4),
                 dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5),
                 dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
                 dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
                 dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=5),
                 dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4))
MID_ROW_TILES = (dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4),
                 dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=5),
                 dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
                 dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
                 dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4))


# Up to UNSORTED_MAX_SLOTS (a decode step of 64 tokens of top-8 routing), these tiles also run without the sort:
# each expert's programs find its slots themselves, a compare and a running sum over every slot, which costs less
# than the sort's launches (three kernels of the counting sort from 257 slots).
UNSORTED_MAX_SLOTS = 512
UNSORTED_TILES = tuple(dict(tile, UNSORTED=True) for tile in (FEW_ROW_TILES[0], FEW_ROW_TILES[2], MID_ROW_TILES[0],
                                                             MID_ROW_TILES[4]))


# Tiles timed per shape and slot bucket (`kernels/tuning.pick`) once each expert sees over 64 rows (prefill):
# wider rows of a tile fill the tensor cores better and pad each expert's group more. A tile marked TMA loads the
# weights through a tensor descriptor (Hopper's TMA unit: one instruction a tile, no address arithmetic per
# element) where it divides the shapes, and through pointers elsewhere. It pays at prefill only, where the loads'
# instructions compete with the tensor cores' work; at decode sizes TMA twins tied the pointer tiles (models.md).
# A tile with GROUP_M runs its programs in groups of that many row tiles (`_grouped_order`): launched row tile
# first, the down GEMM's 8 column blocks each read all 32,768 rows of its input at 4,096 tokens (50 MB, which L2
# does not hold), so that input crossed HBM once per column block. A tile with HALF_TAIL computes a group's last
# tile as BLOCK_M / 2 rows when its second half is padding: at 4,096 tokens of top-8 routing over 128 experts a group
# averages 256 rows, so about half the groups end in a tile of a few dozen rows (tuner, on an H200: 710 against 718
# us at 32,768 slots with TMA, 717 against 744 through pointers; `half_tail_tiles` in bench/results/models_h200.json).
GROUPED_TILES = (dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8),
                 dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
                 dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
                 dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
                 dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
                 dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
                 dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
                 dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=4),
                 dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
                 dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True),
                 dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True, GATED=True),
                 dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, GATED=True),
                 dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True, GATED=True,
                      GROUP_M=8, HALF_TAIL=True),
                 dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, GATED=True, GROUP_M=8,
                      HALF_TAIL=True),
                 dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, GROUP_M=8))


def _grouped_gemm(a, b, c, weights, ids, expert_ids, rows_per_a: int, config: dict, scale=None,
                  a_scale=None, gated: bool = False) -> None:
    """c[slot] = a[slot // rows_per_a] @ b[expert]^T (* weights[slot]); with `scale`, a and b are 8-bit codes
    with row scales `a_scale` [rows of a] and `scale` [E, N]. `ids`: the sorted, padded slot list with each tile's
    `expert_ids`, or for an UNSORTED config the routing ids in slot order (`expert_ids` None). `gated`: b's rows are
    gate then up, and c[slot] = silu(gate) * up of the products, each program taking BLOCK_N / 2 columns of each
    (so the same B bytes a step as the plain tile)."""
    num_experts, rows, k = b.shape
    config = {"GROUP_M": 1, "HALF_TAIL": False, **{key: value for key, value in config.items() if key != "GATED"}}
    if gated:
        config["BLOCK_N"] //= 2
    n = rows // 2 if gated else rows
    slots = triton.next_power_of_2(max(c.shape[0], 16)) if config.pop("UNSORTED", False) else 0
    assert not (slots and (config["GROUP_M"] > 1 or config["HALF_TAIL"])), "GROUP_M and HALF_TAIL need the sort"
    grid = (num_experts if slots else expert_ids.numel(), triton.cdiv(n, config["BLOCK_N"]))
    even = n % config["BLOCK_N"] == 0 and k % config["BLOCK_K"] == 0
    b_desc = None
    if config.get("TMA") and even and b.dtype != torch.int8 and b.is_contiguous():
        b_desc = TensorDescriptor(b.view(num_experts * rows, k), [num_experts * rows, k], [k, 1],
                                  [config["BLOCK_N"], config["BLOCK_K"]])
    _fused_moe_kernel[grid](
        a, b, b_desc, c, c if weights is None else weights, c if scale is None else scale,
        c if a_scale is None else a_scale, ids, ids if expert_ids is None else expert_ids, n, k, c.shape[0],
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0), 0 if scale is None else scale.stride(0),
        ROWS_PER_A=rows_per_a, MUL_WEIGHT=weights is not None, SCALED=scale is not None, IS_INT=b.dtype == torch.int8,
        WIDEN=os.environ.get("TRITON_INTERPRET") == "1", DOT_PRECISION=_dot_precision(c.dtype),
        UPCAST=_upcast_dot(c.dtype), EVEN=even, GATED=gated, SLOTS=slots, **{**config, "TMA": b_desc is not None})


@triton.jit
def _slot_rows(w_ptr, ids_ptr, N, stride_we, stride_wn, BLOCK_N: tl.constexpr):
    """This program's slot, its BLOCK_N output columns (and their mask) and the pointers to those rows of the
    slot's expert's weight."""
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return slot, offs_n, offs_n < N, w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn


@triton.jit
def _moe_gate_up_gemv_kernel(x_ptr, w_ptr, scale_ptr, ids_ptr, out_ptr, I, K, stride_xm, stride_we, stride_wn,
                             stride_om, stride_se, TOP_K: tl.constexpr, SCALED: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[slot, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n]) for the slot's expert e, where
    slot = token * TOP_K + k; rounded where the grouped path rounds (its GEMM output, then silu)."""
    wait_for_previous(PDL)
    slot, offs_n, n_mask, gate_rows = _slot_rows(w_ptr, ids_ptr, I, stride_we, stride_wn, BLOCK_N)
    up_rows = gate_rows + I * stride_wn
    x_row = x_ptr + (slot // TOP_K) * stride_xm
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        gate += tl.sum(tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
        up += tl.sum(tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
    if SCALED:
        scales = scale_ptr + tl.load(ids_ptr + slot).to(tl.int64) * stride_se + offs_n
        gate = gate * tl.load(scales, mask=n_mask, other=0.0)
        up = up * tl.load(scales + I, mask=n_mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + slot * stride_om + offs_n, activated.to(dtype), mask=n_mask)


@triton.jit
def _moe_down_combine_gemv_kernel(a_ptr, w_ptr, scale_ptr, ids_ptr, weights_ptr, out_ptr, N, K, stride_am, stride_we,
                                  stride_wn, stride_om, stride_se, TOP_K: tl.constexpr, SCALED: tl.constexpr,
                                  BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  PDL: tl.constexpr):
    """out[token, n] = sum over the token's TOP_K slots of weight[slot] * (a[slot] . w2[e, n]), e the slot's expert.
    All TOP_K experts' rows stream as one 3-D tile [TOP_K, BLOCK_N, BLOCK_K] per step, so the program keeps
    TOP_K times the loads of a single GEMV in flight. Each slot's product is rounded to the output dtype before
    the sum, where the grouped path rounds it.

    The expert ids and the first BLOCK_K columns of the rows are loaded before the PDL wait, overlapping the gate/up
    GEMV's tail: the ids are the output of the kernel before that one, which is complete once the gate/up GEMV lets
    this kernel launch (it does so only past its own wait). Only `a`, the gate/up GEMV's output, waits."""
    token, slots, k_valid, experts, offs_n = token_slots(ids_ptr, TOP_K, BLOCK_TOPK, BLOCK_N)
    n_mask = offs_n < N
    rows = (w_ptr + experts[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn)
    row_mask = k_valid[:, None, None] & n_mask[None, :, None]
    first_k = tl.arange(0, BLOCK_K)
    w_first = tl.load(rows + first_k[None, None, :], mask=row_mask & (first_k < K)[None, None, :], other=0.0)
    wait_for_previous(PDL)
    a_rows = a_ptr + slots[:, None] * stride_am
    a_first = tl.load(a_rows + first_k[None, :], mask=k_valid[:, None] & (first_k < K)[None, :], other=0.0)
    acc = tl.sum(w_first.to(tl.float32) * a_first.to(tl.float32)[:, None, :], axis=2)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=k_valid[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(rows + offs_k[None, None, :], mask=row_mask & k_mask[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[:, None, :], axis=2)
    if SCALED:
        scales = scale_ptr + experts[:, None] * stride_se + offs_n[None, :]
        acc = acc * tl.load(scales, mask=k_valid[:, None] & n_mask[None, :], other=0.0)
    acc = acc * tl.load(weights_ptr + slots, mask=k_valid, other=0.0).to(tl.float32)[:, None]
    dtype = out_ptr.dtype.element_ty
    out = tl.sum(acc.to(dtype).to(tl.float32), axis=0)
    tl.store(out_ptr + token * stride_om + offs_n, out.to(dtype), mask=n_mask)


GEMV_MAX_SLOTS = 128   # 16 tokens of top-8 routing: above this the grouped path is the only candidate
# Few-token tiles: ((BLOCK_N, BLOCK_K, num_warps) of the gate/up GEMV, (BLOCK_N, BLOCK_K, num_warps) of the
# down-and-combine GEMV, whose tile spans all top_k experts); None is the grouped path. At one token the GEMVs are
# bound by how many loads are in flight, not by the work of a program: on an H200 at Qwen3-30B-A3B's shapes
# (weights cold) one gate/up row and two down rows a program beat four and eight (gate/up 14.0 against 19.5 us,
# down 9.3 against 14.2 us; bench/results/moe_gemv_sweep_h200.json). Wider tiles stay for the larger experts
# (Mixtral) and slot counts; the tuner pairs every gate/up tile with every down tile.
GATE_UP_TILES = ((2, 2048, 2), (1, 1024, 1), (4, 1024, 4), (8, 1024, 4), (16, 512, 8))
DOWN_TILES = ((2, 256, 8), (1, 128, 4), (2, 256, 2), (8, 256, 8), (4, 1024, 8))
GEMV_TILES = tuple(itertools.product(GATE_UP_TILES, DOWN_TILES))
EXPERTS_CANDIDATES = (None, *GEMV_TILES)   # what the tuner times per slot count up to GEMV_MAX_SLOTS


def _few_token_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                       tile: tuple) -> torch.Tensor:
    """`fused_experts` for a few tokens: a gate/up GEMV per (token, expert) slot, then one down GEMV per token
    over its top_k experts that also sums them (see the module docstring)."""
    (up_n, up_k, up_warps), (down_n, down_k, down_warps) = tile
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    num_slots = num_tokens * top_k
    ids = topk_ids.reshape(-1).contiguous()
    scaled = w13_scale is not None
    pdl = launch_options(hidden_states.device)
    activated = torch.empty((num_slots, inter), dtype=hidden_states.dtype, device=hidden_states.device)
    _moe_gate_up_gemv_kernel[(num_slots, triton.cdiv(inter, up_n))](
        hidden_states, w13, w13_scale if scaled else w13, ids, activated, inter, hidden, hidden_states.stride(0),
        w13.stride(0), w13.stride(1), activated.stride(0), w13_scale.stride(0) if scaled else 0, TOP_K=top_k,
        SCALED=scaled, BLOCK_N=up_n, BLOCK_K=up_k, num_warps=up_warps, **pdl)
    out = torch.empty((num_tokens, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    _moe_down_combine_gemv_kernel[(num_tokens, triton.cdiv(hidden, down_n))](
        activated, w2, w2_scale if scaled else w2, ids, topk_weights.reshape(-1).contiguous().float(), out, hidden,
        inter, activated.stride(0), w2.stride(0), w2.stride(1), out.stride(0), w2_scale.stride(0) if scaled else 0,
        TOP_K=top_k, SCALED=scaled, BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_N=down_n, BLOCK_K=down_k,
        num_warps=down_warps, **pdl)
    return out


def _grouped_tile(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                  w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None) -> dict:
    """The grouped GEMMs' tile: the fastest for this shape and power-of-two bucket of slots, timed on uniform random
    routing, of FEW_ROW_TILES up to 16 rows per expert, MID_ROW_TILES up to 64, GROUPED_TILES beyond (and torch's
    grouped GEMM where it takes the operands), with UNSORTED_TILES up to UNSORTED_MAX_SLOTS slots."""
    num_tokens = hidden_states.shape[0]
    num_experts, two_i, hidden = w13.shape
    num_slots = num_tokens * top_k
    bucket = 1 << (num_slots - 1).bit_length()
    key = ("moe_grouped", hidden_states.dtype, w13.dtype, bucket, num_experts, two_i, hidden)
    chosen = tuning.chosen(key)   # every eager prefill call of every MoE layer asks: skip building the candidates
    if chosen is not None:
        return chosen
    rows_per_expert = num_slots / num_experts
    candidates = (FEW_ROW_TILES if rows_per_expert <= 16 else MID_ROW_TILES if rows_per_expert <= 64
                  else GROUPED_TILES)
    if candidates is GROUPED_TILES and moe_grouped_mm.supported(hidden_states, w13, w13_scale):
        candidates += (moe_grouped_mm.GROUPED_MM,)
    if num_slots <= UNSORTED_MAX_SLOTS:
        candidates += UNSORTED_TILES
    if w13_scale is not None:   # 8-bit experts run the activation apart (it quantizes the down GEMM's input)
        candidates = tuple(tile for tile in candidates if not tile.get("GATED"))

    def run(tile, w13_copy, w2_copy):
        routing = _uniform_routing(num_tokens, num_experts, top_k, hidden_states.device)
        return _grouped_experts(hidden_states, w13_copy, w2_copy, *routing, w13_scale, w2_scale, tile)
    return tuning.pick(key, candidates, run, candidates[0], weights=(w13, w2))


def _grouped_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, w13_scale: torch.Tensor | None,
                     w2_scale: torch.Tensor | None, config: dict | None = None) -> torch.Tensor:
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    config = config or _grouped_tile(hidden_states, w13, w2, top_k, w13_scale, w2_scale)
    if config == moe_grouped_mm.GROUPED_MM:
        return moe_grouped_mm.grouped_mm_experts(hidden_states, w13, w2, topk_weights, topk_ids)
    if config.get("UNSORTED"):   # each expert's programs find its slots in the routing ids: no sort
        sorted_ids, expert_ids = topk_ids.reshape(-1).contiguous(), None
    else:
        sorted_ids, expert_ids = align_block_size(topk_ids, num_experts, config["BLOCK_M"])
    gated = w13_scale is None and config.get("GATED", False)   # SiLU-and-mul in the gate/up GEMM's epilogue
    gate_up = torch.empty((num_slots, two_i // 2 if gated else two_i), dtype=hidden_states.dtype,
                          device=hidden_states.device)
    down = torch.empty((num_slots, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    weights = topk_weights.contiguous().float()
    if gated:
        _grouped_gemm(hidden_states, w13, gate_up, None, sorted_ids, expert_ids, top_k, config, gated=True)
        _grouped_gemm(gate_up, w2, down, weights, sorted_ids, expert_ids, 1, config)
    elif w13_scale is None:
        _grouped_gemm(hidden_states, w13, gate_up, None, sorted_ids, expert_ids, top_k, config)
        _grouped_gemm(silu_and_mul(gate_up), w2, down, weights, sorted_ids, expert_ids, 1, config)
    else:   # W8A8: each GEMM's input quantized per row to the experts' format
        x_codes, x_scales = quantize_rows(hidden_states, w13.dtype)
        _grouped_gemm(x_codes, w13, gate_up, None, sorted_ids, expert_ids, top_k, config, w13_scale, x_scales)
        activated = silu_and_mul(gate_up, quant_dtype=w2.dtype)
        _grouped_gemm(activated.codes, w2, down, weights, sorted_ids, expert_ids, 1, config, w2_scale,
                      activated.scales)
    return moe_grouped_mm.combine(down, None, None, top_k)   # the slots' rows are weighted already


@functools.lru_cache(maxsize=16)   # made on a tuner's first timed call, then reused: none made while capturing
def _uniform_routing(num_tokens: int, num_experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of `num_tokens` tokens each sent to top_k distinct experts drawn uniformly (seeded)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k]
    return torch.full((num_tokens, top_k), 1.0 / top_k, device=device), ids.to(device)


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, tile=None,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `fused_experts_reference`: the few-token path or the grouped GEMMs, whichever the tuner
    timed faster for this slot count (`tile` forces one: a GEMV_TILES entry, or "grouped")."""
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not match hidden {hidden}")
    if (w13_scale is None) != (w2_scale is None) or (w13_scale is not None and (
            w13_scale.shape != w13.shape[:2] or w2_scale.shape != w2.shape[:2])):
        raise ValueError("8-bit experts need row scales for both w13 [E, 2I] and w2 [E, H]")
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    hidden_states = hidden_states.contiguous()
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        w13, w2 = w13.contiguous(), w2.contiguous()
    num_slots = num_tokens * top_k
    if tile is None and num_slots <= GEMV_MAX_SLOTS:
        def run(candidate, w13_copy, w2_copy):
            # Timed on uniform random routing, not on this call's: a warm-up batch (or dummy weights) can send
            # every token to the same few experts, where the grouped path wins and real traffic does not.
            routing = _uniform_routing(num_tokens, num_experts, top_k, hidden_states.device)
            return fused_experts(hidden_states, w13_copy, w2_copy, *routing, candidate or "grouped",
                                 w13_scale, w2_scale)
        # Until timed (or where timing can't run), the few-token path up to 4 tokens of top-8 routing.
        default = GEMV_TILES[0] if num_slots <= 32 else None
        key = ("moe_experts", hidden_states.dtype, w13.dtype, num_slots, num_experts, two_i, hidden)
        tile = tuning.pick(key, EXPERTS_CANDIDATES, run, default, weights=(w13, w2)) or "grouped"
    if tile is None or tile == "grouped":
        return _grouped_experts(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    return _few_token_experts(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, tile)
