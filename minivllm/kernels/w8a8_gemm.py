"""8-bit GEMM with per-row scales (W8A8): y[m, n] = sum_k xq[m, k] wq[n, k] * sx[m] * sw[n].

Codes are float8_e4m3fn (products accumulated in fp32) or int8 (accumulated exactly in int32). Large M goes
to the library GEMMs (torch._scaled_mm with row-wise scales, torch._int_mm), which are compute-bound
there. At decode sizes those launch too few tiles and read the weights at about 1 TB/s on an H100 (the
8B layer shapes; bench/results/quant_h100.json), so for M <= 64 a Triton kernel splits K across programs:
each multiplies a BLOCK_M x BLOCK_K tile of codes by a BLOCK_K x BLOCK_N tile of weight codes on the
tensor cores and writes its partial already scaled; one more kernel sums the partials, or each tile's last
slice does (kernels/split_k.py; a candidate like any tile).
At batch 1 every kernel counts: the first version scaled and cast after the sum in four torch ops, which
cost more than the GEMM on the small layers. The configuration
(tile, split) is timed per shape against the library path (kernels/tuning.py).
Reference: `w8a8_reference` (the same codes as floats, products summed in fp32).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minivllm.kernels import tuning
from minivllm.kernels.pdl import launch_options, prefetch_l2, rows_prefetchable, wait_for_previous
from minivllm.kernels.split_k import (choose_split_k, k_slices, num_sms, partials_buffer, split_k_tile, sum_partials,
                                     sum_slices_in_last, tile_tickets)

FP8 = torch.float8_e4m3fn
TRITON_MAX_M = 64
PREFETCH_STEPS = 2   # K steps of weights each program prefetches before it waits for the previous kernel


def w8a8_reference(x_codes, x_scale, w_codes, w_scale, out_dtype) -> torch.Tensor:
    return ((x_codes.float() @ w_codes.float().t()) * x_scale * w_scale.view(1, -1)).to(out_dtype)


def w8a8_library(x_codes, x_scale, w_codes, w_scale, out_dtype) -> torch.Tensor:
    """torch._scaled_mm (fp8, Hopper) or torch._int_mm (int8)."""
    if x_codes.dtype == FP8:
        # row-wise scaled fp8 GEMM produces bf16; other dtypes are cast after
        out = torch._scaled_mm(x_codes, w_codes.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1).float(),
                               out_dtype=torch.bfloat16)
        return out.to(out_dtype)
    M = x_codes.shape[0]
    if M <= 16:   # _int_mm needs more than 16 rows
        x_codes = torch.cat([x_codes, x_codes.new_zeros(17 - M, x_codes.shape[1])])
    acc = torch._int_mm(x_codes, w_codes.t())[:M]
    return (acc.float() * x_scale * w_scale.view(1, -1)).to(out_dtype)


@triton.jit
def dot_8bit(x, w, IS_INT: tl.constexpr, WIDEN: tl.constexpr):
    """x @ w of 8-bit codes: int32 sums for int8, fp32 for fp8."""
    if WIDEN:   # the interpreter has no 8-bit products: the same sums over widened codes
        return tl.dot(x.to(tl.float32), w.to(tl.float32)).to(tl.int32 if IS_INT else tl.float32)
    elif IS_INT:
        return tl.dot(x, w, out_dtype=tl.int32)
    else:
        return tl.dot(x, w, out_dtype=tl.float32)


@triton.jit
def _w8a8_gemm_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, out_ptr, y_ptr, tickets_ptr, M, N, K, k_per_split,
                      stride_xm, stride_wn, stride_os, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      IS_INT: tl.constexpr, WIDEN: tl.constexpr, FUSED_SUM: tl.constexpr,
                      PREFETCH_K: tl.constexpr, PDL: tl.constexpr):
    offs_m, offs_n, mask_m, mask_n, k_start, k_end = split_k_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    if PREFETCH_K > 0:   # the weights depend on no earlier kernel: their first K steps load while it runs
        nbytes = tl.zeros_like(offs_n) + tl.minimum(k_end - k_start, PREFETCH_K)
        prefetch_l2(w_ptr + offs_n.to(tl.int64) * stride_wn + k_start, nbytes, mask_n, PDL)
    wait_for_previous(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if IS_INT else tl.float32)
    ZERO: tl.constexpr = 0 if IS_INT else 0.0
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=ZERO)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=ZERO)
        acc += dot_8bit(x, w, IS_INT, WIDEN)
    # Scaled here (the scales factor out of the sum over K); one split stores y, several store partials.
    x_scale = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    tile = offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(out_ptr + tl.program_id(2) * stride_os + tile, y.to(out_ptr.dtype.element_ty), mask=mask)
    if FUSED_SUM:
        sum_slices_in_last(out_ptr, y_ptr, tickets_ptr, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                           tile, tile, mask, stride_os)


class W8A8Tile(NamedTuple):
    """fused_sum: split-K partials summed by each tile's last slice, not by a second kernel."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int
    fused_sum: bool = False


def split_tiles(M: int, N: int, K: int, device: torch.device, tiles, fills) -> list[W8A8Tile]:
    """Each (BLOCK_N, BLOCK_K, warps, stages) of `tiles` for M rows, with the split-K that fills the GPU about
    `fill` times for each of `fills`; split tiles also with the sum fused."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    out = []
    for block_n, block_k, warps, stages in tiles:
        for fill in fills:
            split = choose_split_k(M, N, K, block_m, block_n, block_k, num_sms(device), fill)
            tile = W8A8Tile(block_m, block_n, block_k, warps, stages, split)
            out += [tile, tile._replace(fused_sum=True)] if split > 1 else [tile]
    return out


def candidates(M: int, N: int, K: int, device: torch.device) -> list[W8A8Tile | None]:
    """Tiles for M rows (None: the library GEMM), each with split-K filling the GPU about 1x, 2x and 4x."""
    # the last two: best on o / down and on gate_up at M = 1 of 17 tiles (H100, bench/kernels/w8a8_tile_sweep.py)
    tiles = [(64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (32, 256, 4, 4), (128, 256, 8, 3), (128, 256, 4, 4),
             (64, 256, 4, 5)]
    # 1x: o_proj's best tile at M = 1 in two sweeps (128 x 256, split 5: 6.4 / 6.5 us against 7.0 / 7.2 for the
    # 2x and 4x splits)
    fills = (1, 2, 4)
    if M > 16:
        # W1's decode steps (M = 64) read the weights at 0.53-0.83 of the copy bandwidth with the tiles
        # above; deeper pipelines and longer K steps keep more loads in flight.
        tiles += [(128, 128, 4, 6), (64, 512, 4, 3), (256, 128, 8, 3), (128, 256, 8, 4)]
        fills = (1, 2, 4)
    return list(dict.fromkeys([None, *split_tiles(M, N, K, device, tiles, fills)]))


def w8a8_triton(x_codes, x_scale, w_codes, w_scale, out_dtype, config: W8A8Tile) -> torch.Tensor:
    M, K = x_codes.shape
    N = w_codes.shape[0]
    k_per_split, split_k = k_slices(K, config.split_k, config.block_k)
    out = partials_buffer(split_k, M, N, x_codes.device, out_dtype)
    grid = (triton.cdiv(M, config.block_m), triton.cdiv(N, config.block_n), split_k)
    tickets = tile_tickets(x_codes.device, grid[0] * grid[1]) if config.fused_sum and split_k > 1 else None
    y = out if tickets is None else torch.empty(M, N, device=x_codes.device, dtype=out_dtype)
    pdl = launch_options(x_codes.device)
    _w8a8_gemm_kernel[grid](
        x_codes, w_codes, x_scale, w_scale, out, y, out if tickets is None else tickets, M, N, K, k_per_split,
        x_codes.stride(0), w_codes.stride(0), out.stride(0), out.stride(1), BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, IS_INT=x_codes.dtype == torch.int8,
        WIDEN=os.environ.get("TRITON_INTERPRET") == "1", FUSED_SUM=tickets is not None,
        PREFETCH_K=PREFETCH_STEPS * config.block_k if pdl["PDL"] and rows_prefetchable(w_codes) else 0, **pdl,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return sum_partials(out, out_dtype) if tickets is None else y


def w8a8_gemm(x_codes, x_scale, w_codes, w_scale, out_dtype) -> torch.Tensor:
    """x_codes [M, K], x_scale [M, 1] fp32, w_codes [N, K], w_scale [N] -> [M, N] in out_dtype (CUDA)."""
    M, K = x_codes.shape
    N = w_codes.shape[0]
    if M > TRITON_MAX_M:
        return w8a8_library(x_codes, x_scale, w_codes, w_scale, out_dtype)
    bucket = 1 << max(0, M - 1).bit_length()
    def run(config, w_codes=w_codes, w_scale=w_scale):
        args = (x_codes, x_scale, w_codes, w_scale, out_dtype)
        return w8a8_library(*args) if config is None else w8a8_triton(*args, config)
    config = tuning.pick(("w8a8", x_codes.dtype, bucket, N, K), candidates(bucket, N, K, x_codes.device), run,
                         default=None, weights=(w_codes, w_scale))
    return run(config)
