"""SiLU-and-mul for gated MLPs: x = [gate | up] along the last dim -> silu(gate) * up.

Rounds like Hugging Face's `act_fn(gate_proj(x)) * up_proj(x)`: silu is computed
in fp32 and rounded to the input dtype, then the product is rounded again. With `quant_dtype` the row is
also quantized for the W8A8 down projection, in one program per row (see kernels/rmsnorm.py); below
FUSED_QUANT_MIN_ROWS rows that one program per row is latency-bound (one 14,336-wide row: 5.8 us on an H100,
against 4.1 for this kernel plus quant_rows), so there the two kernels run. Owns only this function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels.pdl import launch_options, wait_for_previous
from minivllm.kernels.quant_rows import (QuantizedRows, empty_quantized, quant_params, quantize_rows,
                                         store_quantized_row)

FUSED_QUANT_MIN_ROWS = 16


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The plain-PyTorch path (the layer's everywhere but CUDA)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _gated_product(x_row, cols, mask, intermediate_size):
    """silu(gate) rounded to x's dtype, times up, in fp32 (not yet rounded)."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + intermediate_size + cols, mask=mask, other=0.0)
    activated = (gate / (1.0 + tl.exp(-gate))).to(x_row.dtype.element_ty)
    return activated.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, intermediate_size, x_stride,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    out = _gated_product(x_ptr + row * x_stride, cols, mask, intermediate_size)
    tl.store(out_ptr + row * intermediate_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, codes_ptr, scales_ptr, intermediate_size, x_stride,
                               BLOCK: tl.constexpr, QMAX: tl.constexpr,
                               IS_FP8: tl.constexpr, EMULATED_CAST: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    out = _gated_product(x_ptr + row * x_stride, cols, mask, intermediate_size).to(x_ptr.dtype.element_ty)
    store_quantized_row(codes_ptr + row * intermediate_size, scales_ptr + row, out.to(tl.float32), cols, mask,
                        QMAX, IS_FP8, EMULATED_CAST)


def silu_and_mul(x: torch.Tensor, quant_dtype: torch.dtype | None = None):
    """x [..., 2 * intermediate] -> [..., intermediate], as `silu_and_mul_reference` (a QuantizedRows of
    that with `quant_dtype`)."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension {x.shape[-1]} is not even: expected [gate | up]")
    intermediate_size = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if quant_dtype is not None and x2.shape[0] < FUSED_QUANT_MIN_ROWS:
        out = silu_and_mul(x2)
        return QuantizedRows(*quantize_rows(out, quant_dtype), torch.Size((*x.shape[:-1], intermediate_size)),
                             x.dtype)
    if quant_dtype is not None:
        codes, scales = empty_quantized(x2.shape[0], intermediate_size, quant_dtype, x.device)
        if x2.shape[0] > 0 and intermediate_size > 0:
            block = triton.next_power_of_2(intermediate_size)
            _silu_and_mul_quant_kernel[(x2.shape[0],)](
                x2, codes, scales, intermediate_size, x2.stride(0), BLOCK=block,
                **quant_params(quant_dtype), **launch_options(x.device), num_warps=max(1, min(16, block // 1024)))
        return QuantizedRows(codes, scales, torch.Size((*x.shape[:-1], intermediate_size)), x.dtype)
    out = torch.empty((x2.shape[0], intermediate_size), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and intermediate_size > 0:
        block = min(1024, triton.next_power_of_2(intermediate_size))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(intermediate_size, block))](
            x2, out, intermediate_size, x2.stride(0), BLOCK=block, **launch_options(x.device), num_warps=4)
    return out.view(*x.shape[:-1], intermediate_size)
