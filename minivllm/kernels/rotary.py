"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama) applied in place to q and k.

One program per token and block of heads rotates them (its query heads, or its key heads with their values
into the cache): q/k are read and written once, instead of the ~20 elementwise kernels of the plain-PyTorch
path (which under CUDA graphs cost more in launches than in bytes). Math in fp32, like the reference
`RotaryEmbedding.forward` in minivllm/layers/rotary.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import launch_options, wait_for_previous

# Heads a program rotates. A one-token step's kernel is a chain of dependent loads and stores, which a grid over
# blocks of heads runs side by side: on an H200, Qwen3-30B-A3B single stream 399.1 against 390.7 tok/s with one
# program rotating every head of its token in turn (Llama-3-8B 246.4 against 243.7; `rotary_head_blocks` in
# bench/results/decode_ab_h200.json).
BLOCK_HEADS = 8


@triton.jit
def _rotate_heads(row_ptr, norm_ptr, eps, cos, sin, d, d_mask, first, cache_row_ptr, cache_stride_h, store_row,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
                  STORE: tl.constexpr):
    """Rotate, in place, the BLOCK_H heads from `first` (of NUM_HEADS contiguous heads, each 2 * HALF wide, at
    `row_ptr`); with NORM, each head is first RMS-normalised and scaled by the weight at `norm_ptr` (NORM 1: Llama's
    rounding, normalise, round, scale, round; NORM 2: Gemma's, scale by 1 + w in fp32, round once). With STORE, the
    rotated heads also go to the KV cache row at `cache_row_ptr` (if `store_row`: not a padding token)."""
    h = first + tl.arange(0, BLOCK_H)
    dtype = row_ptr.dtype.element_ty
    mask = (h < NUM_HEADS)[:, None] & d_mask[None, :]
    ptr = row_ptr + h[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM > 0:
        w1 = tl.load(norm_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        inv_rms = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        if NORM == 1:
            x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        else:
            x1 = (x1 * inv_rms * (1.0 + w1)).to(dtype).to(tl.float32)
            x2 = (x2 * inv_rms * (1.0 + w2)).to(dtype).to(tl.float32)
    out1 = (x1 * cos - x2 * sin).to(dtype)
    out2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(ptr, out1, mask=mask)
    tl.store(ptr + HALF, out2, mask=mask)
    if STORE:
        cache = cache_row_ptr + h[:, None] * cache_stride_h + d[None, :]
        tl.store(cache, out1, mask=mask & store_row)
        tl.store(cache + HALF, out2, mask=mask & store_row)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, eps, q_stride, k_stride,
                   cos_sin_stride, v_ptr, v_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, cache_stride_block,
                   cache_stride_row, cache_stride_h, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
                   STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr):
    """Program (token, block): query heads block * BLOCK_H.. while block < the query blocks, else the key heads of
    block - query blocks, with their values into the cache under STORE."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = tl.cdiv(NUM_Q_HEADS, BLOCK_H)
    # The positions, the slot mapping and the table are written by no kernel (host copies, a constant): they load
    # before the wait, while the kernel in front still runs.
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + d, mask=d_mask, other=0.0)[None, :]
    slot = 0
    cache_row = 0
    if STORE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        cache_row = (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_row
    wait_for_previous(PDL)
    if block < q_blocks:
        _rotate_heads(q_ptr + token * q_stride, q_norm_ptr, eps, cos, sin, d, d_mask, block * BLOCK_H, q_ptr, 0,
                      False, NUM_Q_HEADS, HALF, BLOCK_H, NORM, False)
    else:
        first = (block - q_blocks) * BLOCK_H
        if STORE:   # this block's values, loaded beside its keys
            h = first + tl.arange(0, BLOCK_H)
            dims = tl.arange(0, 2 * BLOCK_D)
            mask = (h < NUM_K_HEADS)[:, None] & (dims < 2 * HALF)[None, :]
            value = tl.load(v_ptr + token * v_stride + h[:, None] * (2 * HALF) + dims[None, :], mask=mask)
            tl.store(v_cache_ptr + cache_row + h[:, None] * cache_stride_h + dims[None, :], value,
                     mask=mask & (slot >= 0))
        _rotate_heads(k_ptr + token * k_stride, k_norm_ptr, eps, cos, sin, d, d_mask, first, k_cache_ptr + cache_row,
                      cache_stride_h, slot >= 0, NUM_K_HEADS, HALF, BLOCK_H, NORM, STORE)


def apply_rotary_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                  norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0,
                  gemma_norm: bool = False, value: torch.Tensor | None = None,
                  kv_cache: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, KVH, D] (rows may be strided views of a fused qkv tensor; heads and
    dims contiguous) rotated in place by `cos_sin_cache[positions]` ([max_pos, D] fp32: cos | sin). With
    `norm_weights` (q's and k's [D]), each head is RMS-normalised first (Qwen3's and Gemma-3's q/k norms,
    `gemma_norm` for Gemma's `(1 + w)` form): one kernel where the norms and their copies of the strided
    views took four more. With `kv_cache` (`Attention.kv_write_target`: k_cache, v_cache, slot_mapping, heads; a
    cache in the query's dtype), the rotated keys and `value` [T, KVH, D] are also stored in the paged cache."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    assert query.stride(2) == 1 and query.stride(1) == head_dim and key.stride(2) == 1 \
        and key.stride(1) == head_dim, "heads and dims must be contiguous"
    half = head_dim // 2
    q_norm, k_norm = norm_weights if norm_weights is not None else (query, key)
    if kv_cache is not None:
        k_cache, v_cache, slot_mapping, _ = kv_cache
        assert value is not None and value.shape == key.shape and value.stride(2) == 1 \
            and value.stride(1) == head_dim and k_cache.dtype == key.dtype and k_cache.stride() == v_cache.stride()
        store = dict(v_ptr=value, v_stride=value.stride(0), k_cache_ptr=k_cache, v_cache_ptr=v_cache,
                     slot_mapping_ptr=slot_mapping, cache_stride_block=k_cache.stride(0),
                     cache_stride_row=k_cache.stride(1), cache_stride_h=k_cache.stride(2), STORE=True,
                     BLOCK_SIZE=k_cache.shape[1])
    else:
        store = dict(v_ptr=key, v_stride=0, k_cache_ptr=key, v_cache_ptr=key, slot_mapping_ptr=positions,
                     cache_stride_block=0, cache_stride_row=0, cache_stride_h=0, STORE=False, BLOCK_SIZE=1)
    if num_tokens:
        block_h = min(BLOCK_HEADS, triton.next_power_of_2(max(num_q_heads, num_k_heads)))
        blocks = triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h)
        _rotary_kernel[(num_tokens, blocks)](
            positions, query, key, cos_sin_cache, q_norm, k_norm, eps, query.stride(0), key.stride(0),
            cos_sin_cache.stride(0), NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half, BLOCK_H=block_h,
            BLOCK_D=triton.next_power_of_2(half), NORM=0 if norm_weights is None else 2 if gemma_norm else 1,
            **store, **launch_options(query.device), num_warps=4)
    return query, key
