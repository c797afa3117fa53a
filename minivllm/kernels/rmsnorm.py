"""RMSNorm and fused residual-add + RMSNorm, with the Hugging Face semantics as reference.

HF's LlamaRMSNorm normalises in fp32, casts back to the input dtype, then multiplies by the weight
(so the result has the promoted dtype of input and weight). The fused variant first forms
`x + residual` in the input dtype (one rounding, as torch does), which becomes the new residual, and
normalises that rounded sum. With `quant_dtype` the kernel also quantizes its output row for a W8A8
linear layer (`quant_rows.QuantizedRows`, the same codes as quantize_rows on the 16-bit output) and skips
writing the 16-bit row: one kernel instead of two in front of every such layer. The codes are exactly
quant_rows' of the row this kernel computes; on an H100 that row differs from the plain variant's in about
1 value in 10^6 by one bf16 step (most likely the variance summed in another order), so as many codes
are one grid step apart. Owns only these functions; the layers decide where to use them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import launch_options, wait_for_previous
from minivllm.kernels.quant_rows import (QuantizedRows, empty_quantized, quant_params, quantize_rows_reference,
                                         store_quantized_row)


class RowNorm(NamedTuple):
    """An RMSNorm that a one-row GEMV applies to its x first (kernels/dense_gemv.py, kernels/int4_gemv_tma.py):
    weight [K] in x's dtype, eps; where `residual` [1, K] is given, of x + residual, which the kernel also writes
    to `stream` [1, K] (the residual stream's next value); where `normed` [1, K] is given, the normed row is
    written there too, as `rms_norm` computes it (the dense GEMV only)."""
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    stream: torch.Tensor | None = None
    normed: torch.Tensor | None = None


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
                     QMAX: tl.constexpr, IS_FP8: tl.constexpr, EMULATED_CAST: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden_size + cols, x, mask=mask)
    hidden = x.to(tl.float32)
    variance = tl.sum(hidden * hidden, 0) / hidden_size
    normed = (hidden * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * weight.to(tl.float32)).to(out_ptr.dtype.element_ty)
    if QUANT:   # the 16-bit row, quantized as quantize_rows would (masked lanes are 0)
        store_quantized_row(codes_ptr + row * hidden_size, scales_ptr + row, out.to(tl.float32), cols, mask,
                            QMAX, IS_FP8, EMULATED_CAST)
    else:
        tl.store(out_ptr + row * hidden_size + cols, out, mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quant_dtype: torch.dtype | None = None, residual_out: torch.Tensor | None = None):
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
        if residual_out is None:
            new_residual = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        elif residual_out.shape != x.shape or residual_out.dtype != x.dtype or not residual_out.is_contiguous():
            raise ValueError("residual_out must be a contiguous tensor like x")
        else:
            new_residual = residual_out.view(x2.shape)
    else:
        residual2 = new_residual = x2   # unused by the kernel
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, residual2, new_residual, weight, out, codes, scales, hidden_size, eps, x2.stride(0),
            residual2.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block, QUANT=quant_dtype is not None,
            **quant_params(quant_dtype or torch.float8_e4m3fn), **launch_options(x.device),
            num_warps=min(16, max(1, block // 512)))
    result = out.view(x.shape) if quant_dtype is None else QuantizedRows(codes, scales, x.shape, out_dtype)
    return result, (new_residual.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype | None = None):
    """x [..., hidden] -> RMSNorm(x) * weight, as `rms_norm_reference` (a QuantizedRows with `quant_dtype`)."""
    return _launch(x, None, weight, eps, quant_dtype)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       quant_dtype: torch.dtype | None = None, residual_out: torch.Tensor | None = None):
    """-> (RMSNorm(x + residual) * weight, x + residual), as `fused_add_rms_norm_reference` (the first a
    QuantizedRows with `quant_dtype`). Out of place: neither input is modified; x + residual is written to
    `residual_out` where given (a buffer a later kernel was promised), else to a new tensor."""
    return _launch(x, residual, weight, eps, quant_dtype, residual_out)
