"""Scatter this step's keys and values into the paged KV cache (layout: minivllm/attention/metadata.py).

Reference: `minivllm.attention.torch_backend.write_kv_reference`. Owns only the cache write; it never
reads the cache and knows nothing of block tables (the slot mapping already encodes them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                     cache_stride_block, cache_stride_row, cache_stride_h,
                     num_kv_heads, head_dim,
                     BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: all its KV heads at once, so small head counts still move whole rows.
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
    tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token.to(tl.int64) * value_stride_t + heads[:, None] * value_stride_h
                    + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> k_cache/v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] at `slot_mapping` (rows with slot -1 skipped).
    key/value may be strided views (e.g. slices of a fused QKV output) as long as head_dim is dense."""
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
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1)
