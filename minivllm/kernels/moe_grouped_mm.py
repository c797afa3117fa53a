"""Mixture-of-Experts MLP on torch's grouped GEMM, for prefill-sized batches.

At thousands of tokens the experts' GEMMs are compute-bound. torch's grouped GEMM (`torch.nn.functional.grouped_mm`,
CUTLASS's grouped kernel on Hopper, with TMA loads and warp-specialised pipelines) loads its tiles in ways the
Triton grouped GEMM of `fused_moe.py` cannot, since that one gathers each row as it loads it. It needs each
expert's rows contiguous in its input, so this path

1. sorts the token x top-k slots by expert and gathers the hidden rows into that order (`moe_sort.sort_slots`,
   which also gives each group's end and each slot's row),
2. runs gate/up, SiLU-and-mul and down over the sorted rows (no padding: the groups are jagged), and
3. brings every token's top_k rows back together in `_combine_kernel`, which applies the routing weights and sums.
   (The Triton grouped path sums its rows, weighted by its down GEMM already and in slot order, through it too.)

Rounding follows the Triton grouped path: each GEMM rounds once to the model dtype, each slot's weighted row is
rounded before the fp32 sum of a token's slots. The gather and the combine each move every slot's row once more,
so the GEMMs' gain has to pay for them: `fused_moe._grouped_tile` times this path against the Triton tiles per shape
and slot bucket, and it runs only where it measures faster (on an H200 it loses to the Triton tiles at Qwen3-30B-A3B's
shapes from 16,384 to 65,536 slots and wins at Mixtral-8x7B's from 4,096 to 16,384: `tuner_us` in
bench/results/models_h200.json).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels.activation import silu_and_mul
from minivllm.kernels.moe_sort import sort_slots, token_slots
from minivllm.kernels.pdl import launch_options, wait_for_previous

GROUPED_MM = "grouped_mm"   # the tile name `fused_moe` gives this path among its grouped GEMMs' candidates

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def supported(hidden_states: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None) -> bool:
    """Whether torch's grouped GEMM takes these operands: experts in the model's dtype (bf16 on CUDA), and every
    row of every operand a whole number of 16 bytes (the kernel's alignment)."""
    if _grouped_mm is None or w13_scale is not None or w13.dtype != hidden_states.dtype:
        return False
    if hidden_states.is_cuda and (hidden_states.dtype != torch.bfloat16
                                  or torch.cuda.get_device_capability(hidden_states.device) < (9, 0)):
        return False
    two_i, hidden = w13.shape[1:]
    return all(n * hidden_states.element_size() % 16 == 0 for n in (hidden, two_i // 2))


@triton.jit
def _combine_kernel(rows_ptr, position_ptr, weights_ptr, out_ptr, N, stride_rm, stride_om, TOP_K: tl.constexpr,
                    BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, SORTED: tl.constexpr, WEIGHTED: tl.constexpr,
                    PDL: tl.constexpr):
    """out[token, n] = sum over the token's TOP_K slots of round(weight[slot] * rows[position[slot], n]); without
    SORTED the rows are in slot order (position[slot] = slot), without WEIGHTED already weighted."""
    wait_for_previous(PDL)
    token, slots, k_valid, rows, offs_n = token_slots(position_ptr, TOP_K, BLOCK_TOPK, BLOCK_N, LOAD=SORTED)
    mask = k_valid[:, None] & (offs_n < N)[None, :]
    values = tl.load(rows_ptr + rows[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if WEIGHTED:
        weights = tl.load(weights_ptr + slots, mask=k_valid, other=0.0).to(tl.float32)
        values = (values * weights[:, None]).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs_n, tl.sum(values, axis=0).to(dtype), mask=offs_n < N)


def combine_reference(rows: torch.Tensor, position: torch.Tensor | None, weights: torch.Tensor | None,
                      top_k: int) -> torch.Tensor:
    """`_combine_kernel` in PyTorch: rows [S, N] in sorted order (slot order without `position`; already weighted
    without `weights`) -> [S // top_k, N]."""
    rows = rows if position is None else rows[position]
    if weights is not None:
        rows = (rows.float() * weights.reshape(-1, 1).float()).to(rows.dtype)
    return rows.view(-1, top_k, rows.shape[1]).float().sum(dim=1).to(rows.dtype)


def combine(rows: torch.Tensor, position: torch.Tensor | None, weights: torch.Tensor | None,
            top_k: int) -> torch.Tensor:
    """Each token's top_k rows summed in fp32, rounded once (`combine_reference`)."""
    num_slots, n = rows.shape
    out = torch.empty((num_slots // top_k, n), dtype=rows.dtype, device=rows.device)
    block_n = min(1024, triton.next_power_of_2(n))
    _combine_kernel[(num_slots // top_k, triton.cdiv(n, block_n))](
        rows, rows if position is None else position, rows if weights is None else weights.reshape(-1).float(), out,
        n, rows.stride(0), out.stride(0), TOP_K=top_k, BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_N=block_n,
        SORTED=position is not None, WEIGHTED=weights is not None, num_warps=4, **launch_options(rows.device))
    return out


def grouped_mm_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe.fused_experts_reference`'s contract for experts in the model's dtype, through torch's grouped
    GEMM (see the module docstring). The caller checks `supported`."""
    slots = sort_slots(topk_ids, w13.shape[0], hidden_states=hidden_states)
    gate_up = _grouped_mm(slots.rows, w13.transpose(1, 2), offs=slots.ends)
    down = _grouped_mm(silu_and_mul(gate_up), w2.transpose(1, 2), offs=slots.ends)
    return combine(down, slots.position, topk_weights, topk_ids.shape[1])
