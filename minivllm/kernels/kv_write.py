"""Scatter this step's keys and values into the paged KV cache (layout: minivllm/attention/metadata.py).

Reference: `minivllm.attention.torch_backend.write_kv_reference`. Owns only the cache write; it never
reads the cache and knows nothing of block tables (the slot mapping already encodes them). An fp8 cache
gets x / scale in fp32, clamped to e4m3's +-448 (e4m3fn has no infinity: saturating here does not depend
on how each conversion path treats overflow), then rounded to nearest even.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import launch_options, wait_for_previous

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


@triton.jit
def round_to_e4m3_grid(x):
    # Round to nearest even on e4m3's grid in fp32 arithmetic (3 mantissa bits; subnormal step 2^-9):
    # adding 1.5 * 2^23 ulp leaves `ulp` as fp32's last place, so the add itself rounds. Done on |x|
    # so that negative values rounding to zero keep their sign (-0, as the hardware cast gives).
    magnitude = tl.abs(x)
    exponent = tl.floor(tl.log2(tl.maximum(magnitude, 0.015625)))   # below 2^-6: the subnormal step
    magic = tl.exp2(exponent - 3.0) * 12582912.0
    rounded = (magnitude + magic) - magic
    return rounded * tl.where(x < 0, -1.0, 1.0)


@triton.jit
def _quantize(x, scale, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr, EMULATED_CAST: tl.constexpr):
    if QUANTIZE:
        x = x.to(tl.float32) / scale
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        if EMULATED_CAST:
            # Triton 3.6's interpreter casts to fp8 by rounding half up and loses the carry into the
            # exponent (1.97 becomes 1.0); given a value already on the grid, its cast is exact.
            x = round_to_e4m3_grid(x)
    return x


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                     cache_stride_block, cache_stride_row, cache_stride_h,
                     num_kv_heads, head_dim, k_scale, v_scale,
                     BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr, EMULATED_CAST: tl.constexpr,
                     PDL: tl.constexpr):
    # One program per token: all its KV heads at once, so small head counts still move whole rows.
    wait_for_previous(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding row: nothing to store
        return
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    cache_offset = block * cache_stride_block + row * cache_stride_row \
        + heads[:, None] * cache_stride_h + dims[None, :]
    key = tl.load(key_ptr + token.to(tl.int64) * key_stride_t + heads[:, None] * key_stride_h
                  + dims[None, :], mask=mask)
    key = _quantize(key, k_scale, QUANTIZE, FP8_MAX, EMULATED_CAST)
    tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token.to(tl.int64) * value_stride_t + heads[:, None] * value_stride_h
                    + dims[None, :], mask=mask)
    value = _quantize(value, v_scale, QUANTIZE, FP8_MAX, EMULATED_CAST)
    tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> k_cache/v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] at `slot_mapping` (rows with slot -1 skipped).
    key/value may be strided views (e.g. slices of a fused QKV output) as long as head_dim is dense.
    The scales apply to an fp8 cache only (key / k_scale, value / v_scale)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim, k_scale, v_scale,
        BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_D=block_d,
        QUANTIZE=k_cache.dtype == torch.float8_e4m3fn, FP8_MAX=FP8_E4M3_MAX,
        EMULATED_CAST=os.environ.get("TRITON_INTERPRET") == "1", **launch_options(key.device),
        num_warps=4 if block_h * block_d >= 1024 else 1)
