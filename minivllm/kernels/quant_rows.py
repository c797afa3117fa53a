"""Per-row 8-bit quantization (W8A8's dynamic per-token activation scales), one Triton program per row, or
below 16 rows one per 1,024 columns (each reads the whole row for its scale: one 14,336-wide row left to a
single program bounded the batch-1 W8A8 step).

codes[r] = round(clamp(x[r] / s[r], -QMAX, QMAX)), s[r] = max|x[r]| / QMAX, in fp32, into float8_e4m3fn
(QMAX 448) or int8 (QMAX 127, round half to even). The unfused reference, `quantize_rows_reference`, takes
nine kernels per linear layer: at batch 1 about 2.5 ms of a 7 ms Llama-3-8B decode step.
`store_quantized_row` is the same rounding for kernels that produce a whole row anyway (RMSNorm,
SiLU-and-mul): they hand the W8A8 GEMM a `QuantizedRows` instead of a 16-bit row, saving this kernel.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minivllm.kernels.kv_write import round_to_e4m3_grid
from minivllm.kernels.pdl import launch_options, wait_for_previous

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max   # 448
INT8_MAX = 127.0
CHUNKED_BELOW_ROWS = 16   # fewer rows than this: several programs per row (`_quantize_row_chunks_kernel`)
ROW_CHUNK = 1024


def quantize_rows_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row scaled to the 8-bit range: (codes [R, C] in `dtype`, scales [R, 1] fp32)."""
    qmax = FP8_MAX if dtype == FP8 else INT8_MAX
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / qmax
    return round_to_codes(x.float() / scale, dtype), scale


def round_trip_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., C] quantized per row by `quantize_rows_reference` and dequantized, in x's shape and dtype."""
    codes, scale = quantize_rows_reference(x.reshape(-1, x.shape[-1]), dtype)
    return (codes.float() * scale).view(x.shape).to(x.dtype)


def round_to_codes(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values already divided by their scale -> the nearest 8-bit codes (e4m3 or int8), saturating."""
    if dtype == FP8:
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


class QuantizedRows(NamedTuple):
    """Activations already quantized per row by the kernel that produced them: codes [R, C] (8-bit),
    scales [R, 1] fp32, and the shape and dtype the unquantized activations would have had."""
    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.codes.is_cuda


@triton.jit
def store_quantized_row(codes_row_ptr, scale_ptr, x, offs, mask, QMAX: tl.constexpr, IS_FP8: tl.constexpr,
                        EMULATED_CAST: tl.constexpr):
    """One whole row in fp32 (masked lanes 0) -> its codes at `codes_row_ptr + offs` and its scale at
    `scale_ptr`, exactly as `quantize_rows_reference`."""
    scale = row_scale(x, QMAX)
    v = codes_on_grid(x, scale, QMAX, IS_FP8, EMULATED_CAST)
    tl.store(codes_row_ptr + offs, v.to(codes_row_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def row_scale(x, QMAX: tl.constexpr):
    """The scale of one whole row (fp32, masked lanes 0), as `quantize_rows_reference`'s."""
    return tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / QMAX


@triton.jit
def codes_on_grid(x, scale, QMAX: tl.constexpr, IS_FP8: tl.constexpr, EMULATED_CAST: tl.constexpr):
    """fp32 values of a row and its scale -> values whose cast to the 8-bit dtype gives the codes of
    `quantize_rows_reference` (on the grid already, but for fp8 outside the interpreter)."""
    v = tl.math.div_rn(x, scale)   # IEEE division, as torch's: the codes match the reference exactly
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if IS_FP8:
        if EMULATED_CAST:   # the interpreter's fp8 cast is exact only on the grid (see kv_write.py)
            v = round_to_e4m3_grid(v)
    else:
        v = (v + 12582912.0) - 12582912.0   # round half to even in fp32 (1.5 * 2^23), as torch.round
    return v


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, C, stride_x, stride_c,
                          QMAX: tl.constexpr, IS_FP8: tl.constexpr, EMULATED_CAST: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < C
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    store_quantized_row(codes_ptr + row * stride_c, scales_ptr + row, x, offs, mask, QMAX, IS_FP8, EMULATED_CAST)


@triton.jit
def _quantize_row_chunks_kernel(x_ptr, codes_ptr, scales_ptr, C, stride_x, stride_c,
                                QMAX: tl.constexpr, IS_FP8: tl.constexpr, EMULATED_CAST: tl.constexpr,
                                BLOCK: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """A program per (row, CHUNK columns): each reads the whole row for its scale (L2 serves the repeats)
    and rounds only its chunk, so a few long rows are not left to one SM each."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    scale = row_scale(tl.load(x_ptr + row * stride_x + offs, mask=offs < C, other=0.0).to(tl.float32), QMAX)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < C, other=0.0).to(tl.float32)
    v = codes_on_grid(x, scale, QMAX, IS_FP8, EMULATED_CAST)
    tl.store(codes_ptr + row * stride_c + cols, v.to(codes_ptr.dtype.element_ty), mask=cols < C)
    if tl.program_id(1) == 0:
        tl.store(scales_ptr + row, scale)


def quant_params(dtype: torch.dtype) -> dict:
    """The constexprs of `store_quantized_row` for codes of `dtype` (fp8 or int8)."""
    return dict(QMAX=FP8_MAX if dtype == FP8 else INT8_MAX, IS_FP8=dtype == FP8,
                EMULATED_CAST=os.environ.get("TRITON_INTERPRET") == "1")


def empty_quantized(rows: int, cols: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(rows, cols, dtype=dtype, device=device),
            torch.empty(rows, 1, dtype=torch.float32, device=device))


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C]: the kernel on CUDA, the reference elsewhere."""
    if x.is_cuda and x.shape[0]:
        return quantize_rows_triton(x, dtype)
    return quantize_rows_reference(x, dtype)


def quantize_rows_triton(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference` in one kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    codes, scales = empty_quantized(rows, cols, dtype, x.device)
    block = triton.next_power_of_2(cols)
    if rows < CHUNKED_BELOW_ROWS and cols > ROW_CHUNK:
        _quantize_row_chunks_kernel[(rows, triton.cdiv(cols, ROW_CHUNK))](
            x, codes, scales, cols, x.stride(0), codes.stride(0), **quant_params(dtype),
            BLOCK=block, CHUNK=ROW_CHUNK, **launch_options(x.device), num_warps=8)
        return codes, scales
    _quantize_rows_kernel[(rows,)](
        x, codes, scales, cols, x.stride(0), codes.stride(0), **quant_params(dtype),
        BLOCK=block, **launch_options(x.device), num_warps=max(1, min(16, block // 1024)))
    return codes, scales
