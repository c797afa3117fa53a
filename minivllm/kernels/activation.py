"""SiLU-and-mul for gated MLPs: x = [gate | up] along the last dim -> silu(gate) * up.

Rounds like Hugging Face's `act_fn(gate_proj(x)) * up_proj(x)`: silu is computed
in fp32 and rounded to the input dtype, then the product is rounded again. Owns only this function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The plain-PyTorch path (the layer's everywhere but CUDA)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, intermediate_size, x_stride,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + intermediate_size + cols, mask=mask, other=0.0)
    activated = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * intermediate_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * intermediate] -> [..., intermediate], as `silu_and_mul_reference`."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension {x.shape[-1]} is not even: expected [gate | up]")
    intermediate_size = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], intermediate_size), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and intermediate_size > 0:
        block = min(1024, triton.next_power_of_2(intermediate_size))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(intermediate_size, block))](
            x2, out, intermediate_size, x2.stride(0), BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], intermediate_size)
