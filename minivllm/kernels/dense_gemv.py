"""Dense GEMV for 16-bit weights: y = x W^T (+ b) with x one row, as a batch-1 decode step runs every linear layer,
or a few rows (up to `MAX_ROWS`: a decode step of a few sequences, a verify step of one sequence and its drafts).

A step at batch 1 is bound by how fast each weight streams from memory, and for the small matrices of MoE models'
attention and router (a few to 20 MB) cuBLAS's kernels stop short of it: they split K into a second reduction
kernel, or run too few programs to keep enough loads in flight. Here each program owns BLOCK_N output rows and
streams them whole (BLOCK_K columns per load, fp32 sums), so the grid has N / BLOCK_N programs and one kernel
does the layer. Whether it or cuBLAS runs, and with which tile, is timed per weight shape on the GPU
(`kernels/tuning.pick`, cuBLAS among the candidates), so a shape where cuBLAS is faster keeps it. The streaming
tiles (`_gemv_stream_kernel`) are candidates too: a few programs per SM, each streaming a run of whole rows a tile at a
time with the next tile's load in flight, the first tile loaded before the PDL wait, so a short grid launches at once
and its first weight bytes overlap the kernel in front.

A few rows (a weight of at most `ROWS_MAX_WEIGHT_BYTES`) take `_gemv_rows_kernel` (up to 8 rows: each program
streams its weight rows once and multiplies them by every input row on the CUDA cores) or `_gemv_rows_mma_kernel`
(up to 64: the same on the tensor cores, the rows padded to 16 or more), whichever the tuner times fastest against
cuBLAS. Alone, cuBLAS is about as fast at such shapes, but its kernels do not take part in programmatic dependent
launch (kernels/pdl.py), so each one ends the overlap of the Triton kernels around it. On an H200, SmolLM2-135M's
decode graphs of 2, 4 and 8 rows took 924, 921 and 943 us a replay with cuBLAS against 579 for one row; with these
kernels, 599, 722 and 754 (bench/results/spec_decode_h200.json `graph_replay_us` and
`graph_replay_us_before_few_row_gemv`). A batch-1 verify step of k drafts replays the graph of k + 1 rows.

With `norm` (a RowNorm) x is a decoder layer's un-normed input and the GEMV applies the layer's RMSNorm (of
x + residual, which it writes to the residual stream's next value) as it streams, saving the norm's kernel. The
inverse RMS is a scalar of the row, so it factors out of the sum: each program sums w * (x + residual) * norm
weight and the squares of x + residual in one pass over K and scales at the end. The normed row is not rounded to
16 bits before the products, as the norm kernel's output is; `normed` asks for that rounded row too, for the
layer's other consumers (an MoE block's experts). Every program repeats the norm's loads and arithmetic, so the
fold pays only on a small grid (`NORM_FOLD_MAX_ROWS`) or in the streaming tiles, whose few programs each norm the
row once for a run of rows: there it made batch-1 decode 3.2% faster at Qwen3-30B-A3B (its input norm in qkv_proj)
and 2.0% at Llama-3-8B (both norms, in qkv_proj and gate_up_proj) on an H200 (`norm_in_stream_gemv` in
bench/results/decode_ab_h200.json).

Reference: `torch.nn.functional.linear` (after `rmsnorm.fused_add_rms_norm_reference` with a norm).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels import tuning
from minivllm.kernels.pdl import launch_options, wait_for_previous
from minivllm.kernels.rmsnorm import RowNorm
from minivllm.kernels.split_k import num_sms

# (BLOCK_N, BLOCK_K, num_warps): one or two rows a program keep the most loads in flight. Timed on an H200 against
# cuBLAS for the attention, router and MLP shapes of Llama-3-8B, Qwen3-30B-A3B, Mixtral-8x7B and GPT-2 XL, the
# fastest tile at every shape was one of these three (`tuner_us` in bench/results/models_h200.json and
# throughput_w1_h200.json); each candidate costs start-up time to time.
GEMV_TILES = ((1, 1024, 1), (2, 2048, 2), (4, 1024, 4))
# (programs per SM, BLOCK_N, num_warps, "stream") of `_gemv_stream_kernel`, one row of at most STREAM_MAX_K
# columns (a whole row of a BLOCK_N-row tile in registers, the next tile's in flight). Offered to the tuner beside the
# tiles above, on an H200 they made batch-1 decode 1.7% faster at Qwen3-30B-A3B and 1.4% at Llama-3-8B (alternating in
# one process, every shape timed again per setting: `gemv_stream` in bench/results/decode_ab_h200.json).
GEMV_STREAM_TILES = ((4, 2, 4, "stream"), (8, 2, 4, "stream"))
STREAM_MAX_K = 4096
# Most input rows the GEMV takes; the tiles of `_gemv_rows_kernel` (up to 8 rows; each program reads the rows of x
# once per BLOCK_N weight rows, from L2) and of `_gemv_rows_mma_kernel` (marked "mma"; a tile takes rows padded to
# 16 or the next power of 2 while BLOCK_K x rows <= MMA_TILE_ELEMENTS, so x's tile stays at 16 KB).
MAX_ROWS = 64
GEMV_ROWS_TILES = ((1, 1024, 1), (2, 2048, 2), (4, 1024, 4), (2, 1024, 4), (4, 512, 4))
GEMV_MMA_TILES = ((16, 256, 4, "mma"), (32, 128, 4, "mma"), (16, 512, 4, "mma"), (32, 256, 4, "mma"),
                  (16, 128, 4, "mma"), (64, 128, 4, "mma"))
MMA_TILE_ELEMENTS = 8192
# Above one row, only weights up to this size: there a GEMM is a few microseconds, mostly launch and first loads,
# which the PDL overlap hides. With every weight eligible, Qwen3-30B-A3B's batch-8 decode step took 8.28 ms on an H200
# against 7.99 with this bound, which keeps its attention projections (16.8 and 21 MB) in cuBLAS (models_h200.json
# `few_row_gemv`); SmolLM2's largest GEMV weight, gate_up, is 3.5 MB.
ROWS_MAX_WEIGHT_BYTES = 8 << 20


def mma_rows(num_rows: int) -> int:
    """The rows `_gemv_rows_mma_kernel` computes for `num_rows` (the smallest dot is 16)."""
    return max(16, triton.next_power_of_2(num_rows))


@functools.lru_cache(maxsize=None)   # asked on every eager call with a few rows
def rows_tiles(num_rows: int) -> tuple:
    """The GEMV tiles that take `num_rows` (> 1) rows."""
    return GEMV_ROWS_TILES * (num_rows <= 8) + tuple(
        t for t in GEMV_MMA_TILES if t[1] * mma_rows(num_rows) <= MMA_TILE_ELEMENTS)


# The norm folds into projections of at most this many output rows in any tile, of more in the streaming tiles only
# (their few programs norm the row once each for a run of rows). Each kernel's marginal time in batch-1 decode
# steps on an H200 (bench/results/decode_layer_marginals_h200.json): Qwen3-30B-A3B's router (128 rows) with the
# norm folded in took 2.56 us against 2.17 + 1.41 for it and the norm kernel, while its qkv_proj (5,120 rows) took
# 9.18 against 6.43 + 1.57, and Llama-3-8B's (6,144 rows) 16.58 against 13.63 + 1.86, one or two rows a program: on
# a large grid of those the repeated norm costs more than the launch it saves.
NORM_FOLD_MAX_ROWS = 1024


@triton.jit
def _write_row_share(x_ptr, residual_ptr, norm_weight_ptr, stream_ptr, normed_ptr, K, inv_rms, ADD: tl.constexpr,
                     WRITE_NORMED: tl.constexpr, WRITE_BLOCK: tl.constexpr):
    """This program's share of the row for the kernels after a GEMV with the norm folded in: x + residual (the
    residual stream's next value) and the normed row, rounded as kernels/rmsnorm.py rounds them."""
    dtype = x_ptr.dtype.element_ty
    offs = tl.program_id(0) * WRITE_BLOCK + tl.arange(0, WRITE_BLOCK)
    inside = offs < K
    row = tl.load(x_ptr + offs, mask=inside, other=0.0)
    if ADD:
        residual = tl.load(residual_ptr + offs, mask=inside, other=0.0)
        row = (row.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(stream_ptr + offs, row, mask=inside)
    if WRITE_NORMED:   # normalised, rounded, scaled, rounded
        normed = (row.to(tl.float32) * inv_rms).to(dtype).to(tl.float32)
        normed *= tl.load(norm_weight_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(normed_ptr + offs, normed.to(dtype), mask=inside)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, residual_ptr, norm_weight_ptr, stream_ptr, normed_ptr, N, K, stride_wn,
                 eps, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, WRITE_NORMED: tl.constexpr,
                 WRITE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[n] = x . w[n] (+ b[n]); NORM: of RMSNorm(x (+ residual)) * norm weight."""
    wait_for_previous(PDL)
    dtype = x_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if NORM:
            if ADD:   # the residual stream's next value, rounded as it is stored
                x = (x + tl.load(residual_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
            squares += x * x
            x = x * tl.load(norm_weight_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if NORM:
        inv_rms = tl.math.rsqrt(tl.sum(squares, 0) / K + eps)
        acc *= inv_rms
        if ADD or WRITE_NORMED:
            _write_row_share(x_ptr, residual_ptr, norm_weight_ptr, stream_ptr, normed_ptr, K, inv_rms, ADD, WRITE_NORMED,
                             WRITE_BLOCK)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_stream_kernel(x_ptr, w_ptr, b_ptr, out_ptr, residual_ptr, norm_weight_ptr, stream_ptr, normed_ptr, N, K,
                        stride_wn, rows_per_program, eps, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
                        WRITE_NORMED: tl.constexpr, WRITE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[n] = x . w[n] (+ b[n]) for one row of x (NORM: of RMSNorm(x (+ residual)) * norm weight, as `_gemv_kernel`
    computes it): each program streams `rows_per_program` whole rows (K <= BLOCK_K), BLOCK_N at a time, with the
    next BLOCK_N rows' load issued before the current ones are reduced. The first rows are loaded before the PDL wait
    (weights are no earlier kernel's output)."""
    first = tl.program_id(0) * rows_per_program
    last = tl.minimum(first + rows_per_program, N)
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    offs_r = tl.arange(0, BLOCK_N)
    columns = w_ptr + offs_k[None, :]
    rows = first + offs_r
    w = tl.load(columns + rows[:, None].to(tl.int64) * stride_wn, mask=(rows < last)[:, None] & k_mask[None, :],
                other=0.0)
    wait_for_previous(PDL)
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if NORM:
        if ADD:   # the residual stream's next value, rounded as it is stored
            x = (x + tl.load(residual_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(x * x, 0) / K + eps)
        if ADD or WRITE_NORMED:
            _write_row_share(x_ptr, residual_ptr, norm_weight_ptr, stream_ptr, normed_ptr, K, inv_rms, ADD, WRITE_NORMED,
                             WRITE_BLOCK)
        x = x * tl.load(norm_weight_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    for start in range(first, last, BLOCK_N):
        rows = start + offs_r
        upcoming = rows + BLOCK_N
        w_next = tl.load(columns + upcoming[:, None].to(tl.int64) * stride_wn,
                         mask=(upcoming < last)[:, None] & k_mask[None, :], other=0.0)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if NORM:
            acc *= inv_rms
        _store_row(out_ptr, acc, b_ptr, rows, rows < last, HAS_BIAS)
        w = w_next


@triton.jit
def _row_dot(w, x_ptr, offs_k, k_mask):
    """w . x for one row of x: [BLOCK_N] fp32 sums, as the one-row kernel reduces."""
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    return tl.sum(w * x[None, :], axis=1)


@triton.jit
def _store_row(out_ptr, acc, b_ptr, offs_n, n_mask, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, HAS_BIAS: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = x[m] . w[n] (+ b[n]) for the M rows of x, 1 < M <= ROWS (2, 4 or 8). One accumulator per row,
    each reduced as the one-row kernel reduces its row (one [ROWS, BLOCK_N, BLOCK_K] product reduced over K timed
    slower on an H200 at SmolLM2's shapes). Rows past M read and write nothing."""
    wait_for_previous(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    a0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a4 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a5 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a6 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a7 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        a0 += _row_dot(w, x_ptr, offs_k, k_mask)
        a1 += _row_dot(w, x_ptr + stride_xm, offs_k, k_mask & (M > 1))
        if ROWS > 2:
            a2 += _row_dot(w, x_ptr + 2 * stride_xm, offs_k, k_mask & (M > 2))
            a3 += _row_dot(w, x_ptr + 3 * stride_xm, offs_k, k_mask & (M > 3))
        if ROWS > 4:
            a4 += _row_dot(w, x_ptr + 4 * stride_xm, offs_k, k_mask & (M > 4))
            a5 += _row_dot(w, x_ptr + 5 * stride_xm, offs_k, k_mask & (M > 5))
            a6 += _row_dot(w, x_ptr + 6 * stride_xm, offs_k, k_mask & (M > 6))
            a7 += _row_dot(w, x_ptr + 7 * stride_xm, offs_k, k_mask & (M > 7))
    _store_row(out_ptr, a0, b_ptr, offs_n, n_mask, HAS_BIAS)
    _store_row(out_ptr + N, a1, b_ptr, offs_n, n_mask & (M > 1), HAS_BIAS)
    if ROWS > 2:
        _store_row(out_ptr + 2 * N, a2, b_ptr, offs_n, n_mask & (M > 2), HAS_BIAS)
        _store_row(out_ptr + 3 * N, a3, b_ptr, offs_n, n_mask & (M > 3), HAS_BIAS)
    if ROWS > 4:
        _store_row(out_ptr + 4 * N, a4, b_ptr, offs_n, n_mask & (M > 4), HAS_BIAS)
        _store_row(out_ptr + 5 * N, a5, b_ptr, offs_n, n_mask & (M > 5), HAS_BIAS)
        _store_row(out_ptr + 6 * N, a6, b_ptr, offs_n, n_mask & (M > 6), HAS_BIAS)
        _store_row(out_ptr + 7 * N, a7, b_ptr, offs_n, n_mask & (M > 7), HAS_BIAS)


@triton.jit
def _gemv_rows_mma_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, HAS_BIAS: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                          PDL: tl.constexpr):
    """The rows kernel's product on the tensor cores: BLOCK_N weight rows times x's M rows padded to ROWS (`mma_rows`;
    the padding rows are zeros that are never stored)."""
    wait_for_previous(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    n_mask, m_mask = offs_n < N, offs_m < M
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_mask[None, :] & k_mask[:, None],
                    other=0.0)
        if UPCAST:   # Triton 3.6's interpreter multiplies bf16 blocks as their raw bits
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])


def _norm_arguments(x: torch.Tensor, norm: RowNorm | None, grid: int) -> dict:
    """The one-row kernels' norm arguments for `norm` over a grid of `grid` programs (x stands in for the tensors a
    call without them does not read)."""
    k = x.shape[-1]
    share = {"WRITE_BLOCK": max(16, triton.next_power_of_2(triton.cdiv(k, grid)))}
    if norm is None:
        return {"residual_ptr": x, "norm_weight_ptr": x, "stream_ptr": x, "normed_ptr": x, "eps": 0.0, "NORM": False,
                "ADD": False, "WRITE_NORMED": False, **share}
    residual, normed = norm.residual, norm.normed
    return {"residual_ptr": x if residual is None else residual.contiguous(), "norm_weight_ptr": norm.weight,
            "stream_ptr": x if norm.stream is None else norm.stream, "normed_ptr": x if normed is None else normed,
            "eps": norm.eps, "NORM": True, "ADD": residual is not None, "WRITE_NORMED": normed is not None, **share}


def _gemv_stream(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: tuple,
                 norm: RowNorm | None) -> torch.Tensor:
    """`gemv` with a `GEMV_STREAM_TILES` tile (on the CPU, as if on 4 SMs)."""
    programs_per_sm, block_n, warps = tile[:3]
    n, k = weight.shape
    if k > STREAM_MAX_K:
        raise ValueError(f"the streaming GEMV takes rows of at most {STREAM_MAX_K} columns")
    per_program = triton.cdiv(triton.cdiv(n, programs_per_sm * num_sms(x.device)), block_n) * block_n
    grid = triton.cdiv(n, per_program)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _gemv_stream_kernel[(grid,)](
        x, weight, weight if bias is None else bias, out, N=n, K=k, stride_wn=weight.stride(0),
        rows_per_program=per_program, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k),
        num_warps=warps, **_norm_arguments(x, norm, grid), **launch_options(x.device))
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: tuple[int, int, int],
         norm: RowNorm | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x of at most `MAX_ROWS` rows (a [1, K] row or [K]: one) with the given tile;
    with `norm` (one row only), of x's RMSNorm (see the module docstring)."""
    block_n, block_k, warps = tile[:3]
    n, k = weight.shape
    num_rows = x.numel() // k
    if num_rows > 1:
        if norm is not None:
            raise ValueError("the GEMV folds a norm into one row only")
        if tile not in rows_tiles(num_rows):
            raise ValueError(f"the GEMV tile {tile} does not take {num_rows} rows")
        rows = x.reshape(num_rows, k)
        rows = rows if rows.stride(1) == 1 else rows.contiguous()
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
        if tile in GEMV_MMA_TILES:
            _gemv_rows_mma_kernel[(triton.cdiv(n, block_n),)](
                rows, weight, weight if bias is None else bias, out, num_rows, n, k, rows.stride(0), weight.stride(0),
                HAS_BIAS=bias is not None, ROWS=mma_rows(num_rows), BLOCK_N=block_n, BLOCK_K=block_k,
                UPCAST=not x.is_cuda, num_warps=warps, **launch_options(x.device))
            return out
        _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
            rows, weight, weight if bias is None else bias, out, num_rows, n, k, rows.stride(0), weight.stride(0),
            HAS_BIAS=bias is not None, ROWS=triton.next_power_of_2(num_rows), BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, **launch_options(x.device))
        return out
    x = x.contiguous()
    if tile[-1] == "stream":
        return _gemv_stream(x, weight, bias, tile, norm)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    grid = triton.cdiv(n, block_n)
    _gemv_kernel[(grid,)](
        x, weight, weight if bias is None else bias, out, N=n, K=k, stride_wn=weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **_norm_arguments(x, norm, grid), **launch_options(x.device))
    return out


def takes_rows(num_rows: int, weight: torch.Tensor) -> bool:
    """One row against any weight, or up to `MAX_ROWS` against one of at most `ROWS_MAX_WEIGHT_BYTES`."""
    return num_rows == 1 or (1 < num_rows <= MAX_ROWS
                             and weight.numel() * weight.element_size() <= ROWS_MAX_WEIGHT_BYTES)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """16-bit rows on the GPU that `takes_rows`, against a row-major weight of their dtype."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.stride(1) == 1 and takes_rows(x.numel() // max(x.shape[-1], 1), weight))


def folds_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes a `norm` for this call: one row, and a small grid (NORM_FOLD_MAX_ROWS) or rows the
    streaming tiles take (STREAM_MAX_K)."""
    return (supports(x, weight) and x.numel() == x.shape[-1]
            and (weight.shape[0] <= NORM_FOLD_MAX_ROWS or x.shape[-1] <= STREAM_MAX_K))


@functools.lru_cache(maxsize=None)   # asked on every eager call
def linear_candidates(rows: int, weight_shape: tuple[int, int], norm: bool) -> tuple:
    """What the tuner times for `linear` at `rows` (a power of 2) against a weight of `weight_shape` [N, K]: cuBLAS
    (None, not with a norm folded in) and the GEMV tiles that take the rows."""
    n, k = weight_shape
    tiles = GEMV_TILES if rows == 1 else rows_tiles(rows)
    candidates = tiles if norm else (None, *tiles)
    if rows == 1 and k <= STREAM_MAX_K:
        # a large grid repeats the norm in every program: only the streaming tiles' few programs take it there
        candidates = GEMV_STREAM_TILES if norm and n > NORM_FOLD_MAX_ROWS else (*candidates, *GEMV_STREAM_TILES)
    return candidates


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           norm: RowNorm | None = None) -> torch.Tensor:
    """`F.linear` for a few rows (`supports`) through cuBLAS or the GEMV, whichever the tuner timed faster for this
    weight shape and row count (rounded up to a power of 2); with `norm` (where `folds_norm`), through the GEMV with
    the tile timed fastest with the norm folded in."""
    rows = triton.next_power_of_2(x.numel() // x.shape[-1])
    key = ("dense_gemv", x.dtype, tuple(weight.shape), bias is not None, *("norm",) * (norm is not None),
           *(("rows", rows),) * (rows > 1))

    def run(candidate, w):
        return F.linear(x, w, bias) if candidate is None else gemv(x, w, bias, candidate, norm)
    candidates = linear_candidates(rows, key[2], norm is not None)
    tile = tuning.pick(key, candidates, run, candidates[0], weights=(weight,))
    return F.linear(x, weight, bias) if tile is None else gemv(x, weight, bias, tile, norm)
