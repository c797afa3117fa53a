"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama) applied in place to q and k.

One program per token rotates every query and key head of that token: the cos/sin row is read once and
q/k are read and written once, instead of the ~20 elementwise kernels of the plain-PyTorch path (which
under CUDA graphs cost more in launches than in bytes). Math in fp32, like the reference
`RotaryEmbedding.forward` in minivllm/layers/rotary.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import launch_options, wait_for_previous


@triton.jit
def _rotate_heads(row_ptr, cos, sin, d, d_mask,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate, in place, the NUM_HEADS contiguous heads (each 2 * HALF wide) starting at `row_ptr`."""
    heads = tl.arange(0, BLOCK_H)
    for start in tl.static_range(0, NUM_HEADS, BLOCK_H):
        h = start + heads
        mask = (h < NUM_HEADS)[:, None] & d_mask[None, :]
        ptr = row_ptr + h[:, None] * (2 * HALF) + d[None, :]
        x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr, (x1 * cos - x2 * sin).to(row_ptr.dtype.element_ty), mask=mask)
        tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_stride, k_stride, cos_sin_stride,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + d, mask=d_mask, other=0.0)[None, :]
    _rotate_heads(q_ptr + token * q_stride, cos, sin, d, d_mask, NUM_Q_HEADS, HALF, BLOCK_H)
    _rotate_heads(k_ptr + token * k_stride, cos, sin, d, d_mask, NUM_K_HEADS, HALF, BLOCK_H)


def apply_rotary_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                  cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, KVH, D] (rows may be strided views of a fused qkv tensor; heads and
    dims contiguous) rotated in place by `cos_sin_cache[positions]` ([max_pos, D] fp32: cos | sin)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    assert query.stride(2) == 1 and query.stride(1) == head_dim and key.stride(2) == 1 \
        and key.stride(1) == head_dim, "heads and dims must be contiguous"
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, query, key, cos_sin_cache, query.stride(0), key.stride(0), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half,
            BLOCK_H=min(16, triton.next_power_of_2(max(num_q_heads, num_k_heads))),
            BLOCK_D=triton.next_power_of_2(half), **launch_options(query.device), num_warps=4)
    return query, key
