"""Paged varlen attention for prefill, chunked prefill, prefix-cache hits and mixed batches.

Reference: `minivllm.attention.torch_backend.paged_attention_reference`. Each sequence's query rows
are its last `q_len` tokens; they attend causally to the cached prefix and to themselves, all read
through the block table (this step's K/V must already be written to the cache).

FlashAttention-2 style: a program owns BLOCK_Q query tokens of one sequence times all query heads of
one KV head (GQA heads are folded into the M dimension, so a K/V tile is loaded once per group and a
one-token decode row still fills part of a tile), streams BLOCK_N-key tiles with an online softmax in
fp32, and never visits tiles that lie wholly above the causal diagonal. Tiles wholly below the
diagonal skip the mask arithmetic.

The grid depends only on shapes: sequence i's tiles are numbered from `query_start_loc[i] // BLOCK_Q
+ i`, an upper bound on the tiles before it, so `num_tokens // BLOCK_Q + batch` programs per KV
head cover every tile; a program finds its sequence by binary search on device (no host sync), and
the few surplus programs exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.decode_attention import LOG2_E, _dot, _dot_precision, _upcast_dot


@triton.jit
def _attention_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, kv_head, kv_start,
                    kv_end, query_positions, dims, dim_mask, qk_scale,
                    cache_stride_block, cache_stride_row, cache_stride_h,
                    MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    positions = kv_start + tl.arange(0, BLOCK_N)
    valid = positions < kv_end
    pages = tl.load(block_table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = pages * cache_stride_block + (positions % BLOCK_SIZE) * cache_stride_row \
        + kv_head * cache_stride_h
    k = tl.load(k_cache_ptr + rows[None, :] + dims[:, None],
                mask=valid[None, :] & dim_mask[:, None], other=0.0)               # [D, N]
    scores = _dot(q, k, DOT_PRECISION, UPCAST) * qk_scale                         # [M, N]
    if MASKED:
        visible = (positions[None, :] <= query_positions[:, None]) & valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.math.exp2(scores - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :],
                mask=valid[:, None] & dim_mask[None, :], other=0.0)               # [N, D]
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return acc, m_new, l_i


# Batch size and block-table width change every step; specialising on them would recompile mid-run.
@triton.jit(do_not_specialize=["num_seqs", "block_table_stride"])
def _prefill_kernel(
        query_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        qk_scale, num_seqs, num_queries_per_kv, head_dim,
        query_stride_t, query_stride_h, out_stride_t, out_stride_h,
        cache_stride_block, cache_stride_row, cache_stride_h, block_table_stride,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The sequence owning this tile: the last i with query_start_loc[i] // BLOCK_Q + i <= tile.
    # (Both bounds are int32 tensors: loop-carried values may not start as constants.)
    low = tile * 0
    high = low + num_seqs
    while high - low > 1:
        middle = (low + high) // 2
        if tl.load(query_start_loc_ptr + middle) // BLOCK_Q + middle <= tile:
            low = middle
        else:
            high = middle
    seq = low
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_token = (tile - (query_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_token >= query_len:  # surplus program: its sequence has fewer tiles than the bound
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len   # cached tokens before this step's query chunk

    # Row r of the tile is query token first_token + r // GROUP_PAD, head r % GROUP_PAD of the group.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tokens = first_token + rows // GROUP_PAD
    group = rows % GROUP_PAD
    row_mask = (tokens < query_len) & (group < num_queries_per_kv)
    heads = kv_head * num_queries_per_kv + group
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    token_rows = (query_start + tokens).to(tl.int64)
    q = tl.load(query_ptr + token_rows[:, None] * query_stride_t + heads[:, None] * query_stride_h
                + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    query_positions = context_len + tokens

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    # Keys before the tile's first query position are visible to every row: no mask needed.
    # Both loops start at key 0 or continue from it, so every row's running max is finite after
    # the first tile (key 0 is visible to all rows) and no -inf - -inf NaN can arise.
    unmasked_end = (context_len + first_token + 1) // BLOCK_N * BLOCK_N
    kv_end = context_len + tl.minimum(first_token + BLOCK_Q, query_len)
    for kv_start in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attention_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, kv_head, kv_start, kv_end,
            query_positions, dims, dim_mask, qk_scale,
            cache_stride_block, cache_stride_row, cache_stride_h,
            False, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST)
    for kv_start in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attention_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, kv_head, kv_start, kv_end,
            query_positions, dims, dim_mask, qk_scale,
            cache_stride_block, cache_stride_row, cache_stride_h,
            True, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST)

    # An empty context (a padding row with seq_len 0) yields zeros, as in the reference.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token_rows[:, None] * out_stride_t + heads[:, None] * out_stride_h
             + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & dim_mask[None, :])


def _tile_config(head_dim: int, dtype: torch.dtype,
                 max_query_len: int | None) -> tuple[int, int, int, int]:
    """(rows per tile, keys per tile, warps, pipeline stages), from a sweep on an H100 in bf16 with
    32 query / 8 KV heads: at head_dim 128, 128x64 tiles with 8 warps lead on long prompts
    (306 TFLOP/s at 1x4096) while 128x32 with 4 warps leads up to ~2k tokens (169 vs 144 at 8x512);
    two stages beat three or four everywhere. fp32 and wide heads take smaller tiles."""
    if dtype == torch.float32 or head_dim > 128:
        return 64, 32, 4, 2
    if head_dim > 64 and max_query_len is not None and max_query_len <= 2048:
        return 128, 32, 4, 2
    return 128, 64, 8, 2


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float,
                            max_query_len: int | None = None, block_m: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> output of the same shape (rows not covered by
    `query_start_loc` are left unwritten). `max_query_len` (a host-side hint, e.g. the metadata's)
    only picks the tile shape; `block_m` (query rows x heads per tile) and `block_n` override it,
    powers of two, for tests."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert query.dtype == k_cache.dtype == v_cache.dtype and k_cache.stride() == v_cache.stride()
    assert query.stride(2) == 1 and k_cache.stride(3) == 1
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_queries_per_kv = num_heads // num_kv_heads
    default_m, default_n, num_warps, num_stages = _tile_config(head_dim, query.dtype, max_query_len)
    block_m = block_m or default_m
    block_n = block_n or default_n
    group_pad = triton.next_power_of_2(num_queries_per_kv)
    block_q = max(1, block_m // group_pad)
    # tl.dot needs at least 16 rows; a wide group with a tiny block_m still gets them.
    block_q = max(block_q, triton.cdiv(16, group_pad))
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, num_seqs, num_queries_per_kv, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, GROUP_PAD=group_pad, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), DOT_PRECISION=_dot_precision(query.dtype),
        UPCAST=_upcast_dot(query.dtype), num_warps=num_warps, num_stages=num_stages)
    return out
