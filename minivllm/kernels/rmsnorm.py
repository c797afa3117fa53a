"""RMSNorm and fused residual-add + RMSNorm, with the Hugging Face semantics as reference.

HF's LlamaRMSNorm normalises in fp32, casts back to the input dtype, then multiplies by the weight
(so the result has the promoted dtype of input and weight). The fused variant first forms
`x + residual` in the input dtype (one rounding, as torch does), which becomes the new residual, and
normalises that rounded sum. With `quant_dtype` the kernel also quantizes its output row for a W8A8
linear layer (`quant_rows.QuantizedRows`, the same codes as quantize_rows on the 16-bit output) and skips
writing the 16-bit row: one kernel instead of two in front of every such layer (below 16 rows a program per
1,024 columns, as quant_rows: each forms the whole row for the scale and stores its chunk). The codes are exactly
quant_rows' of the row this kernel computes; on an H100 that row differs from the plain variant's in about
1 value in 10^6 by one bf16 step (most likely the variance summed in another order), so as many codes
are one grid step apart. Owns only these functions; the layers decide where to use them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.quant_rows import (CHUNKED_BELOW_ROWS, ROW_CHUNK, QuantizedRows, codes_on_grid,
                                         empty_quantized, quant_params, quantize_row_block, quantize_rows_reference,
                                         row_scale)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain-PyTorch path (the layer's everywhere but CUDA): normalised in fp32, rounded, then scaled."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


def quantized_reference(out: torch.Tensor, quant_dtype: torch.dtype | None):
    """The reference of a norm or activation whose output a W8A8 layer takes already quantized."""
    if quant_dtype is None:
        return out
    codes, scales = quantize_rows_reference(out.reshape(-1, out.shape[-1]), quant_dtype)
    return QuantizedRows(codes, scales, out.shape, out.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, new_residual_ptr, weight_ptr, out_ptr, codes_ptr, scales_ptr,
                     hidden_size, eps, x_stride, residual_stride,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                     QMAX: tl.constexpr, IS_FP8: tl.constexpr, EMULATED_CAST: tl.constexpr,
                     CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x, inv_rms = _add_and_rms(x_ptr, residual_ptr, new_residual_ptr, row, cols, mask, hidden_size, eps,
                              x_stride, residual_stride, HAS_RESIDUAL, CHUNK == 0)
    out = _normed_times_weight(x, inv_rms, weight_ptr, cols, mask, out_ptr.dtype.element_ty)
    if QUANT and CHUNK > 0:
        # few rows, a program per CHUNK columns: the scale from the whole row, the codes (and the new
        # residual) of this chunk only, its values formed again by the same operations
        scale = row_scale(out.to(tl.float32), QMAX)
        chunk = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        chunk_mask = chunk < hidden_size
        x_chunk, _ = _add_and_rms(x_ptr, residual_ptr, new_residual_ptr, row, chunk, chunk_mask, hidden_size, eps,
                                  x_stride, residual_stride, HAS_RESIDUAL, True)
        out = _normed_times_weight(x_chunk, inv_rms, weight_ptr, chunk, chunk_mask, out_ptr.dtype.element_ty)
        v = codes_on_grid(out.to(tl.float32), scale, QMAX, IS_FP8, EMULATED_CAST)
        tl.store(codes_ptr + row * hidden_size + chunk, v.to(codes_ptr.dtype.element_ty), mask=chunk_mask)
        if tl.program_id(1) == 0:
            tl.store(scales_ptr + row, scale)
    elif QUANT:   # the 16-bit row, quantized as quantize_rows would (masked lanes are 0)
        v, scale = quantize_row_block(out.to(tl.float32), QMAX, IS_FP8, EMULATED_CAST)
        tl.store(codes_ptr + row * hidden_size + cols, v.to(codes_ptr.dtype.element_ty), mask=mask)
        tl.store(scales_ptr + row, scale)
    else:
        tl.store(out_ptr + row * hidden_size + cols, out, mask=mask)


@triton.jit
def _add_and_rms(x_ptr, residual_ptr, new_residual_ptr, row, cols, mask, hidden_size, eps, x_stride,
                 residual_stride, HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr):
    """x (+ residual, rounded, stored as the new residual) at `cols` of the row, and 1 / rms over those cols."""
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE_RESIDUAL:
            tl.store(new_residual_ptr + row * hidden_size + cols, x, mask=mask)
    hidden = x.to(tl.float32)
    return x, tl.math.rsqrt(tl.sum(hidden * hidden, 0) / hidden_size + eps)


@triton.jit
def _normed_times_weight(x, inv_rms, weight_ptr, cols, mask, out_dtype: tl.constexpr):
    normed = (x.to(tl.float32) * inv_rms).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    return (normed.to(tl.float32) * weight.to(tl.float32)).to(out_dtype)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quant_dtype: torch.dtype | None = None):
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match hidden size {hidden_size}")
    x2 = x.reshape(-1, hidden_size)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if quant_dtype is None:
        out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        codes = scales = out   # unused by the kernel
    else:
        codes, scales = empty_quantized(x2.shape[0], hidden_size, quant_dtype, x.device)
        out = torch.empty(0, dtype=out_dtype, device=x.device)   # not written: only its dtype is read
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must match x in shape and dtype")
        residual2 = residual.reshape(-1, hidden_size)
        if residual2.stride(-1) != 1:
            residual2 = residual2.contiguous()
        new_residual = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        residual2 = new_residual = x2   # unused by the kernel
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden_size)
        chunked = quant_dtype is not None and x2.shape[0] < CHUNKED_BELOW_ROWS and hidden_size > ROW_CHUNK
        _rms_norm_kernel[(x2.shape[0], triton.cdiv(hidden_size, ROW_CHUNK) if chunked else 1)](
            x2, residual2, new_residual, weight, out, codes, scales, hidden_size, eps, x2.stride(0),
            residual2.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block, QUANT=quant_dtype is not None,
            **quant_params(quant_dtype or torch.float8_e4m3fn), CHUNK=ROW_CHUNK if chunked else 0,
            num_warps=min(16, max(1, block // 512)))
    result = out.view(x.shape) if quant_dtype is None else QuantizedRows(codes, scales, x.shape, out_dtype)
    return result, (new_residual.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype | None = None):
    """x [..., hidden] -> RMSNorm(x) * weight, as `rms_norm_reference` (a QuantizedRows with `quant_dtype`)."""
    return _launch(x, None, weight, eps, quant_dtype)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       quant_dtype: torch.dtype | None = None):
    """-> (RMSNorm(x + residual) * weight, x + residual), as `fused_add_rms_norm_reference` (the first a
    QuantizedRows with `quant_dtype`). Out of place: neither input is modified."""
    return _launch(x, residual, weight, eps, quant_dtype)
