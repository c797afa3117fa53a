"""One-row dense GEMV for 16-bit weights: y = x W^T (+ b) with x a single row, as a batch-1 decode step runs every
linear layer.

A step at batch 1 is bound by how fast each weight streams from memory, and for the small matrices of MoE models'
attention and router (a few to 20 MB) cuBLAS's kernels stop short of it: they split K into a second reduction
kernel, or run too few programs to keep enough loads in flight. Here each program owns BLOCK_N output rows and
streams them whole (BLOCK_K columns per load, fp32 sums), so the grid has N / BLOCK_N programs and one kernel
does the layer. Whether it or cuBLAS runs, and with which tile, is timed per weight shape on the GPU
(`kernels/tuning.pick`, cuBLAS among the candidates), so a shape where cuBLAS is faster keeps it.

With `norm` (a RowNorm) x is a decoder layer's un-normed input and the GEMV applies the layer's RMSNorm (of
x + residual, which it writes to the residual stream's next value) as it streams, saving the norm's kernel. The
inverse RMS is a scalar of the row, so it factors out of the sum: each program sums w * (x + residual) * norm
weight and the squares of x + residual in one pass over K and scales at the end. The normed row is not rounded to
16 bits before the products, as the norm kernel's output is; `normed` asks for that rounded row too, for the
layer's other consumers (an MoE block's experts). Every program repeats the norm's loads and arithmetic, so the
fold pays only on a small grid (`NORM_FOLD_MAX_ROWS`).

Reference: `torch.nn.functional.linear` (after `rmsnorm.fused_add_rms_norm_reference` with a norm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels import tuning
from minivllm.kernels.pdl import launch_options, wait_for_previous
from minivllm.kernels.rmsnorm import RowNorm

# (BLOCK_N, BLOCK_K, num_warps): one or two rows a program keep the most loads in flight. Timed on an H200 against
# cuBLAS for the attention, router and MLP shapes of Llama-3-8B, Qwen3-30B-A3B, Mixtral-8x7B and GPT-2 XL, the
# fastest tile at every shape was one of these three (`tuner_us` in bench/results/models_h200.json and
# throughput_w1_h200.json); each candidate costs start-up time to time.
GEMV_TILES = ((1, 1024, 1), (2, 2048, 2), (4, 1024, 4))


# The norm folds into projections of at most this many output rows. Each kernel's marginal time in batch-1 decode
# steps on an H200 (bench/results/decode_layer_marginals_h200.json): Qwen3-30B-A3B's router (128 rows) with the
# norm folded in took 2.56 us against 2.17 + 1.41 for it and the norm kernel, while its qkv_proj (5,120 rows) took
# 9.18 against 6.43 + 1.57, and Llama-3-8B's (6,144 rows) 16.58 against 13.63 + 1.86: on a large grid the repeated
# norm costs more than the launch it saves.
NORM_FOLD_MAX_ROWS = 1024


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
        if ADD or WRITE_NORMED:   # this program's share of the row, for the kernels after this one
            offs = tl.program_id(0) * WRITE_BLOCK + tl.arange(0, WRITE_BLOCK)
            inside = offs < K
            row = tl.load(x_ptr + offs, mask=inside, other=0.0)
            if ADD:
                residual = tl.load(residual_ptr + offs, mask=inside, other=0.0)
                row = (row.to(tl.float32) + residual.to(tl.float32)).to(dtype)
                tl.store(stream_ptr + offs, row, mask=inside)
            if WRITE_NORMED:   # as kernels/rmsnorm.py rounds: normalised, rounded, scaled, rounded
                normed = (row.to(tl.float32) * inv_rms).to(dtype).to(tl.float32)
                normed *= tl.load(norm_weight_ptr + offs, mask=inside, other=0.0).to(tl.float32)
                tl.store(normed_ptr + offs, normed.to(dtype), mask=inside)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: tuple[int, int, int],
         norm: RowNorm | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a [1, K] row (or [K]) with the given tile; with `norm`, of x's RMSNorm (see
    the module docstring)."""
    block_n, block_k, warps = tile
    n, k = weight.shape
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    grid = triton.cdiv(n, block_n)
    residual = stream = normed = norm_weight = None
    if norm is not None:
        norm_weight, residual, stream, normed = norm.weight, norm.residual, norm.stream, norm.normed
    _gemv_kernel[(grid,)](
        x, weight, weight if bias is None else bias, out, x if residual is None else residual.contiguous(),
        x if norm_weight is None else norm_weight, x if stream is None else stream, x if normed is None else normed,
        n, k, weight.stride(0), 0.0 if norm is None else norm.eps, HAS_BIAS=bias is not None, NORM=norm is not None,
        ADD=residual is not None, WRITE_NORMED=normed is not None,
        WRITE_BLOCK=max(16, triton.next_power_of_2(triton.cdiv(k, grid))), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, **launch_options(x.device))
    return out


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A single 16-bit row on the GPU against a row-major weight of its dtype."""
    return (x.is_cuda and x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(1) == 1)


def folds_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes a `norm` for this call: one row (`supports`) and a small grid (NORM_FOLD_MAX_ROWS)."""
    return supports(x, weight) and weight.shape[0] <= NORM_FOLD_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           norm: RowNorm | None = None) -> torch.Tensor:
    """`F.linear` for one row through cuBLAS or the GEMV, whichever the tuner timed faster for this weight shape;
    with `norm` (where `folds_norm`), through the GEMV with the tile timed fastest with the norm folded in."""
    key = ("dense_gemv", x.dtype, tuple(weight.shape), bias is not None, *("norm",) * (norm is not None))

    def run(candidate, w):
        return F.linear(x, w, bias) if candidate is None else gemv(x, w, bias, candidate, norm)
    candidates = GEMV_TILES if norm is not None else (None, *GEMV_TILES)
    tile = tuning.pick(key, candidates, run, candidates[0], weights=(weight,))
    return F.linear(x, weight, bias) if tile is None else gemv(x, weight, bias, tile, norm)
