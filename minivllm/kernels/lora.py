"""Batched LoRA for a step whose token rows use different adapters: a shrink (x · A) and an expand (· B),
as Punica computes them, in Triton, with the plain-PyTorch reference beside each.

Adapter weights sit in slots, one per resident adapter. For a layer whose output packs S projections
(qkv: 3, gate_up: 2, else 1) with rank R:
    lora_a [slots, K, S * R]   columns j*R ... (j + 1)*R hold projection j's A (zero past the adapter's rank)
    lora_b [slots, R, N]       projection j's B in its own output columns, already multiplied by the scaling
so one shrink computes every projection's x · A at once, and the expand adds projection j's
shrunk[:, j*R:(j+1)*R] · B into its columns of y.

Rows are grouped by slot, not padded per adapter: `sorted_token_ids` lists the rows that use an adapter,
ordered by slot, and a block table (`block_table`) cuts each slot's run of it into blocks of BLOCK_M rows: per
block its slot, first and end index into `sorted_token_ids`; slot -1 past the last block. A step of T rows over any mix of
adapters needs at most cdiv(T, BLOCK_M) + slots - 1 blocks, so the grids depend on the shapes only, never on the
step's mix: the kernels are captured in CUDA graphs and a replay reads that step's table from the same buffers.
Launching one program per possible block instead of one per (slot, block) keeps a long prompt chunk from
launching `slots` times the programs it needs. A decode row costs the same kernel as a prompt chunk's rows
(Punica's segment-grouped form covers both). Rows without an adapter are never read or written.

The shrink splits K over programs (one token's A read by one program would take one SM's bandwidth); each
split writes its own partial [split, rows, S * R] in fp32, and the expand loads all of a row block's partials
in one 3-D load and sums them, so no atomics and no zeroing are needed. Where the shrink rode on the base GEMM
(lora/layers.py stacks every slot's A under a dense weight), the expand reads the row's own slot's columns of
that GEMM's output instead. Both kernels launch with programmatic dependent launch on Hopper (kernels/pdl.py):
at batch 1 each is a few microseconds of launch and latency, not of bytes.
"""
from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl

    from minivllm.kernels.pdl import launch_options, wait_for_previous
except ImportError:   # CPU-only installs use the references
    triton = None

DECODE_ROWS = 256     # steps of at most this many rows take the decode tiles (row blocks of 16, many K splits)
BLOCK_MS = (16, 64)   # the row-block sizes the kernels use: the block tables LoRABatch keeps


# ---- references ---------------------------------------------------------------------------------------------
def lora_shrink_reference(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """[T, S*R] fp32: row t is x[t] · lora_a[token_slots[t]], zero where token_slots[t] < 0."""
    out = torch.zeros(x.shape[0], lora_a.shape[2], dtype=torch.float32, device=x.device)
    for slot in token_slots[token_slots >= 0].unique().tolist():
        rows = token_slots == slot
        out[rows] = x[rows].float() @ lora_a[slot].float()
    return out


def lora_expand_reference(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                          slice_widths: tuple[int, ...]) -> torch.Tensor:
    """y (in place) += each row's shrunk slice j · its slot's B of projection j, in that projection's columns."""
    rank = lora_b.shape[1]
    for slot in token_slots[token_slots >= 0].unique().tolist():
        rows = token_slots == slot
        column = 0
        for j, width in enumerate(slice_widths):
            delta = shrunk[rows, j * rank:(j + 1) * rank] @ lora_b[slot, :, column:column + width].float()
            y[rows, column:column + width] = (y[rows, column:column + width].float() + delta).to(y.dtype)
            column += width
    return y


# ---- the step's mapping -------------------------------------------------------------------------------------
def block_m_for(num_tokens: int) -> int:
    return BLOCK_MS[0] if num_tokens <= DECODE_ROWS else BLOCK_MS[1]


def max_blocks(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Blocks any mix of `num_tokens` rows over `num_slots` adapters can need: the grid's first dimension. With
    rows in k slots, each slot's last block may be partly filled, so at most cdiv(T, block_m) + k - 1, and
    k <= min(slots, T): one block for a single decode row."""
    return max(1, -(-num_tokens // block_m) + min(num_slots, num_tokens) - 1)


def sort_rows(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows using an adapter ordered by slot, each slot's row count)."""
    rows = np.flatnonzero(token_slots >= 0)
    slots = token_slots[rows]
    return rows[np.argsort(slots, kind="stable")], np.bincount(slots, minlength=num_slots)


def block_table(counts: np.ndarray, block_m: int, num_blocks: int) -> np.ndarray:
    """[3, num_blocks] int32: per block its slot, first and end index into the sorted rows; slot -1 when unused."""
    starts = np.concatenate([[0], np.cumsum(counts)])
    per_slot = -(-counts // block_m)
    slot = np.repeat(np.arange(len(counts)), per_slot)
    first = starts[slot] + block_m * (np.arange(slot.size) - np.repeat(np.cumsum(per_slot) - per_slot, per_slot))
    table = np.zeros((3, num_blocks), dtype=np.int32)
    table[0] = -1
    table[:, :slot.size] = slot, first, starts[slot + 1]
    return table


# ---- Triton -------------------------------------------------------------------------------------------------
def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def shrink_split_k(num_tokens: int, k: int) -> int:
    """K splits of the shrink: many for a decode step (its A is read once, spread over SMs), few for long chunks,
    where the row blocks already fill the GPU. The expand sums them all in one load, so they stay few."""
    decode = num_tokens <= DECODE_ROWS
    per_split = 256 if decode else 1024
    return max(1, min(16 if decode else 8, k // per_split))


if triton is not None:
    @triton.jit
    def _block_rows(sorted_ids_ptr, table_ptr, stride_t, pid_b, BLOCK_M: tl.constexpr):
        """(slot, row ids, their mask) of row block pid_b; slot < 0: no such block this step."""
        slot = tl.load(table_ptr + pid_b)
        row0 = tl.load(table_ptr + stride_t + pid_b)
        end = tl.load(table_ptr + 2 * stride_t + pid_b)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        return slot, tl.load(sorted_ids_ptr + offs_m, mask=mask_m, other=0).to(tl.int64), mask_m

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """fp32 inputs multiply exactly (the CPU references' precision), not in TF32."""
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _lora_shrink_kernel(x_ptr, a_ptr, out_ptr, sorted_ids_ptr, table_ptr, K, SR, k_per_split,
                            stride_xm, stride_al, stride_ak, stride_os, stride_om, stride_t,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                            IEEE: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)   # before the early return too (kernels/pdl.py)
        pid_b, pid_k = tl.program_id(0), tl.program_id(1)
        slot, tokens, mask_m = _block_rows(sorted_ids_ptr, table_ptr, stride_t, pid_b, BLOCK_M)
        if slot < 0:
            return
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < SR
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        a_base = a_ptr + slot.to(tl.int64) * stride_al
        for k in range(k_lo, k_hi, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            x = tl.load(x_ptr + tokens[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            a = tl.load(a_base + offs_k[:, None] * stride_ak + offs_r[None, :],
                        mask=mask_k[:, None] & mask_r[None, :], other=0.0)
            acc += _dot(x, a, IEEE)
        tl.store(out_ptr + pid_k * stride_os + tokens[:, None] * stride_om + offs_r[None, :], acc,
                 mask=mask_m[:, None] & mask_r[None, :])

    @triton.jit
    def _lora_expand_kernel(shrunk_ptr, b_ptr, y_ptr, sorted_ids_ptr, table_ptr, R, width0, width1, width2,
                            split_k, stride_ss, stride_sm, stride_sl, stride_bl, stride_br, stride_ym, stride_t,
                            BLOCKS_PER_SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_R: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        pid_b, pid_n = tl.program_id(0), tl.program_id(1)
        slot, tokens, mask_m = _block_rows(sorted_ids_ptr, table_ptr, stride_t, pid_b, BLOCK_M)
        # Which packed projection this program's columns belong to: blocks never straddle two of them.
        piece = pid_n // BLOCKS_PER_SLICE
        block = pid_n % BLOCKS_PER_SLICE
        width = tl.where(piece == 0, width0, tl.where(piece == 1, width1, width2))
        column0 = tl.where(piece == 0, 0, tl.where(piece == 1, width0, width0 + width1))
        if (slot < 0) | (block * BLOCK_N >= width):
            return
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < width
        offs_s = tl.arange(0, SPLITS)
        partials = tl.load(shrunk_ptr + offs_s[:, None, None] * stride_ss + tokens[None, :, None] * stride_sm
                           + slot * stride_sl + piece * R + offs_r[None, None, :],
                           mask=(offs_s < split_k)[:, None, None] & mask_m[None, :, None] & mask_r[None, None, :],
                           other=0.0)
        shrunk = tl.sum(partials, axis=0)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None] * stride_br + column0 + offs_n[None, :],
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        delta = _dot(shrunk.to(b.dtype), b, IEEE)
        y_ptrs = y_ptr + tokens[:, None] * stride_ym + column0 + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor,
                table: torch.Tensor) -> torch.Tensor:
    """Partials [split, T, S*R] fp32 whose sum over splits is the reference's shrink, on the rows the block
    table (`block_table` for `block_m_for(T)`) covers; other rows are left unwritten."""
    num_tokens, k = x.shape
    num_slots, _, sr = lora_a.shape
    assert x.stride(1) == 1 and lora_a.stride(2) == 1 and lora_a.shape[1] == k
    split_k = shrink_split_k(num_tokens, k)
    decode = num_tokens <= DECODE_ROWS
    block_k = 64 if decode else 32
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(split_k, num_tokens, sr, dtype=torch.float32, device=x.device)
    block_m = block_m_for(num_tokens)
    grid = (max_blocks(num_tokens, num_slots, block_m), split_k)
    _lora_shrink_kernel[grid](x, lora_a, out, sorted_token_ids, table, k, sr, k_per_split,
                              x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0), out.stride(1),
                              table.stride(0), BLOCK_M=block_m, BLOCK_K=block_k,
                              BLOCK_R=max(16, _next_power_of_2(sr)), IEEE=x.dtype == torch.float32,
                              **launch_options(x.device))
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, sorted_token_ids: torch.Tensor,
                table: torch.Tensor, slice_widths: tuple[int, ...]) -> torch.Tensor:
    """y (in place) += the expand of `shrunk` on the adapter rows. `shrunk` is lora_shrink's partials
    [split, T, S*R], or [T, slots * S*R] with every slot's x · A side by side (a stacked GEMM's extra columns)."""
    num_tokens = y.shape[0]
    num_slots, rank, n = lora_b.shape
    if shrunk.dim() == 2:   # one "split", and each slot's own columns
        split_k, strides = 1, (0, shrunk.stride(0), shrunk.shape[1] // num_slots)
        assert shrunk.stride(1) == 1 and shrunk.shape[1] % num_slots == 0
    else:
        split_k, strides = shrunk.shape[0], (shrunk.stride(0), shrunk.stride(1), 0)
    assert y.stride(1) == 1 and lora_b.stride(2) == 1 and sum(slice_widths) == n and 1 <= len(slice_widths) <= 3
    widths = list(slice_widths) + [0] * (3 - len(slice_widths))
    block_n = 128 if num_tokens <= DECODE_ROWS else 64
    blocks_per_slice = triton.cdiv(max(slice_widths), block_n)
    block_m = block_m_for(num_tokens)
    grid = (max_blocks(num_tokens, num_slots, block_m), blocks_per_slice * len(slice_widths))
    _lora_expand_kernel[grid](shrunk, lora_b, y, sorted_token_ids, table, rank, *widths, split_k, *strides,
                              lora_b.stride(0), lora_b.stride(1), y.stride(0), table.stride(0),
                              BLOCKS_PER_SLICE=blocks_per_slice, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_R=max(16, _next_power_of_2(rank)), SPLITS=_next_power_of_2(split_k),
                              IEEE=y.dtype == torch.float32, **launch_options(y.device))
    return y
