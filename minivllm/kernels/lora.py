"""Batched LoRA for a step whose token rows use different adapters: a shrink (x · A) and an expand (· B),
as Punica computes them, in Triton, with the plain-PyTorch reference beside each.

Adapter weights sit in slots, one per resident adapter. For a layer whose output packs S projections
(qkv: 3, gate_up: 2, else 1) with rank R:
    lora_a [slots, K, S * R]   columns j*R ... (j + 1)*R hold projection j's A (zero past the adapter's rank)
    lora_b [slots, R, N]       projection j's B in its own output columns, already multiplied by the scaling
so one shrink computes every projection's x · A at once, and the expand adds projection j's
shrunk[:, j*R:(j+1)*R] · B into its columns of y.

Rows are grouped by slot, not padded per adapter: `sorted_token_ids` lists the rows that use an adapter,
ordered by slot, and `slot_starts[s] : slot_starts[s + 1]` is slot s's run of it. The grids depend on the
shapes only (rows, slots, columns), never on the step's mix, so the kernels are captured in CUDA graphs and
a replay reads that step's mapping from the same buffers. A program whose block of its slot's run is empty
returns at once; a decode row costs the same kernel as a prompt chunk's rows (Punica's segment-grouped
form covers both). Rows without an adapter are never read or written.

The shrink splits K over programs (one token's A read by one program would take one SM's bandwidth); each
split writes its own partial [split, rows, S * R] in fp32, and the expand sums the partials as it loads
them, so no atomics and no zeroing are needed.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs use the references
    triton = None


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


# ---- Triton -------------------------------------------------------------------------------------------------
def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def shrink_split_k(num_tokens: int, k: int) -> int:
    """K splits of the shrink: many for a few rows (a decode step reads A once, spread over SMs), few for long
    chunks, where the row blocks already fill the GPU."""
    per_split = 256 if num_tokens <= 16 else 1024
    return max(1, min(32 if num_tokens <= 16 else 8, k // per_split))


if triton is not None:
    @triton.jit
    def _slot_rows(sorted_ids_ptr, slot_starts_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
        """(row ids, their mask, whether any) of block pid_m of the slot's run in the sorted rows."""
        row0 = tl.load(slot_starts_ptr + slot) + pid_m * BLOCK_M
        end = tl.load(slot_starts_ptr + slot + 1)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        return tl.load(sorted_ids_ptr + offs_m, mask=mask_m, other=0).to(tl.int64), mask_m, row0 < end

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """fp32 inputs multiply exactly (the CPU references' precision), not in TF32."""
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _lora_shrink_kernel(x_ptr, a_ptr, out_ptr, sorted_ids_ptr, slot_starts_ptr, K, SR, k_per_split,
                            stride_xm, stride_al, stride_ak, stride_os, stride_om,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                            IEEE: tl.constexpr):
        pid_m, pid_k, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        tokens, mask_m, has_rows = _slot_rows(sorted_ids_ptr, slot_starts_ptr, slot, pid_m, BLOCK_M)
        if not has_rows:
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
    def _lora_expand_kernel(shrunk_ptr, b_ptr, y_ptr, sorted_ids_ptr, slot_starts_ptr, R, width0, width1, width2,
                            split_k, stride_ss, stride_sm, stride_bl, stride_br, stride_ym,
                            BLOCKS_PER_SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
        pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        tokens, mask_m, has_rows = _slot_rows(sorted_ids_ptr, slot_starts_ptr, slot, pid_m, BLOCK_M)
        if not has_rows:
            return
        # Which packed projection this program's columns belong to: blocks never straddle two of them.
        piece = pid_n // BLOCKS_PER_SLICE
        block = pid_n % BLOCKS_PER_SLICE
        width = tl.where(piece == 0, width0, tl.where(piece == 1, width1, width2))
        column0 = tl.where(piece == 0, 0, tl.where(piece == 1, width0, width0 + width1))
        if block * BLOCK_N >= width:
            return
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < width
        shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        s_ptrs = shrunk_ptr + tokens[:, None] * stride_sm + piece * R + offs_r[None, :]
        for split in range(0, split_k):
            shrunk += tl.load(s_ptrs + split * stride_ss, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None] * stride_br + column0 + offs_n[None, :],
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        delta = _dot(shrunk.to(b.dtype), b, IEEE)
        y_ptrs = y_ptr + tokens[:, None] * stride_ym + column0 + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _block_m(num_tokens: int) -> int:
    return 16 if num_tokens <= 16 else 64


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor,
                slot_starts: torch.Tensor) -> torch.Tensor:
    """Partials [split, T, S*R] fp32 whose sum over splits is the reference's shrink, on the rows of
    `sorted_token_ids[:slot_starts[-1]]`; other rows are left unwritten."""
    num_tokens, k = x.shape
    num_slots, _, sr = lora_a.shape
    assert x.stride(1) == 1 and lora_a.stride(2) == 1 and lora_a.shape[1] == k
    split_k = shrink_split_k(num_tokens, k)
    block_k = 64 if num_tokens <= 16 else 32
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(split_k, num_tokens, sr, dtype=torch.float32, device=x.device)
    block_m = _block_m(num_tokens)
    grid = (triton.cdiv(num_tokens, block_m), split_k, num_slots)
    _lora_shrink_kernel[grid](x, lora_a, out, sorted_token_ids, slot_starts, k, sr, k_per_split,
                              x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0), out.stride(1),
                              BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=max(16, _next_power_of_2(sr)),
                              IEEE=x.dtype == torch.float32)
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, sorted_token_ids: torch.Tensor,
                slot_starts: torch.Tensor, slice_widths: tuple[int, ...]) -> torch.Tensor:
    """y (in place) += the expand of `shrunk` (lora_shrink's partials) on the adapter rows."""
    num_tokens = y.shape[0]
    num_slots, rank, n = lora_b.shape
    assert y.stride(1) == 1 and lora_b.stride(2) == 1 and sum(slice_widths) == n and 1 <= len(slice_widths) <= 3
    widths = list(slice_widths) + [0] * (3 - len(slice_widths))
    block_n = 128 if num_tokens <= 16 else 64
    blocks_per_slice = triton.cdiv(max(slice_widths), block_n)
    block_m = _block_m(num_tokens)
    grid = (triton.cdiv(num_tokens, block_m), blocks_per_slice * len(slice_widths), num_slots)
    _lora_expand_kernel[grid](shrunk, lora_b, y, sorted_token_ids, slot_starts, rank, *widths, shrunk.shape[0],
                              shrunk.stride(0), shrunk.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
                              BLOCKS_PER_SLICE=blocks_per_slice, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_R=max(16, _next_power_of_2(rank)), IEEE=y.dtype == torch.float32)
    return y
