"""Paged varlen attention for prefill, chunked prefill, prefix-cache hits and mixed batches.

Reference: `minivllm.attention.torch_backend.paged_attention_reference`. Each sequence's query rows
are its last `q_len` tokens; they attend causally to the cached prefix and to themselves, all read
through the block table (this step's K/V must already be written to the cache).

FlashAttention-2 style: a program owns BLOCK_Q query tokens of one sequence times all query heads of
one KV head (GQA heads are folded into the M dimension, so a K/V tile is loaded once per group and a
one-token decode row still fills part of a tile), streams BLOCK_N-key tiles with an online softmax in
fp32, and never visits tiles that lie wholly above the causal diagonal. Tiles wholly below the
diagonal skip the mask arithmetic and load without masks (so loads stay 16 bytes wide and pipelined).

The grid depends only on shapes: sequence i's tiles are numbered from `query_start_loc[i] // BLOCK_Q
+ i`, an upper bound on the tiles before it, so `num_tokens // BLOCK_Q + batch` programs per KV
head cover every tile; a program finds its sequence by counting offsets on device (no host sync),
and the few surplus programs exit at once. Programs run heaviest query tiles first (the longest
key ranges start early, short ones fill the launch's tail). The tile shape comes from a small
table keyed on the host-side `max_query_len` (never autotuned: the launch is captured in CUDA graphs).
An fp8 cache is read as in the decode kernel: tiles widened to the query's dtype in registers, the
key scale folded into the softmax scale and the value scale applied to the output.

Per-layer options, compiled in only when used (constexpr flags): a logit soft cap (scores s ->
c * tanh(s / c), before the mask) and a sliding window W (row at position p sees keys p - W < k <= p).
With a window the key loop starts at the tile's first visible key; tiles that straddle a row's
window start are masked like the diagonal ones, and every tile inside all rows' windows and below
the diagonal stays unmasked.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minivllm.kernels.decode_attention import _dot, _dot_precision, _tanh, _upcast_dot, score_scales

SEARCH_BLOCK = 64   # sequences whose query offsets a program scans per vector load


@triton.jit
def _attention_tile(acc, m_i, l_i, q, k_base, v_base, block_table, kv_start, kv_end,
                    query_positions, dims, dim_mask, qk_scale, softcap_scale, sliding_window,
                    cache_stride_block, cache_stride_row,
                    MASKED: tl.constexpr, EVEN_D: tl.constexpr, TRANS_K: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr):
    positions = kv_start + tl.arange(0, BLOCK_N)
    valid = positions < kv_end
    if MASKED:
        pages = tl.load(block_table + positions // BLOCK_SIZE, mask=valid, other=0)
    else:
        pages = tl.load(block_table + positions // BLOCK_SIZE)
    rows = pages.to(tl.int64) * cache_stride_block + (positions % BLOCK_SIZE) * cache_stride_row
    v_ptrs = v_base + rows[:, None] + dims[None, :]                                # [N, D]
    if TRANS_K:
        k_ptrs = k_base + rows[:, None] + dims[None, :]                            # [N, D]
        k_mask = valid[:, None] & dim_mask[None, :]
        kd_mask = dim_mask[None, :]
    else:
        k_ptrs = k_base + rows[None, :] + dims[:, None]                            # [D, N]
        k_mask = valid[None, :] & dim_mask[:, None]
        kd_mask = dim_mask[:, None]
    # Tiles below the diagonal hold only valid keys: their loads need no mask at all.
    if MASKED:
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=kd_mask, other=0.0)
    k = k.to(q.dtype)   # an fp8 cache widens here (exactly); a no-op otherwise
    if TRANS_K:
        k = tl.trans(k)
    scores = _dot(q, k, DOT_PRECISION, UPCAST)                                     # [M, N]
    if SOFTCAP:   # tanh of the scaled score; qk_scale then holds cap * log2(e)
        scores = _tanh(scores * softcap_scale)
    if MASKED:
        visible = (positions[None, :] <= query_positions[:, None]) & valid[None, :]
        if USE_WINDOW:
            visible = visible & (positions[None, :] > query_positions[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
    # The softmax scale (times log2 e) is folded into one multiply-add per score.
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    if USE_WINDOW and MASKED:
        # A row whose window starts past this tile has seen no key yet (m_new = -inf): subtract 0
        # instead, so its p and alpha are 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.math.exp2(scores * qk_scale - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=valid[:, None] & dim_mask[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=dim_mask[None, :], other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return acc, m_new, l_i


# Batch size and block-table width change every step; specialising on them would recompile mid-run.
@triton.jit(do_not_specialize=["num_seqs", "block_table_stride"])
def _prefill_kernel(
        query_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        qk_scale, v_scale, softcap_scale, sliding_window,
        num_seqs, num_kv_heads, num_queries_per_kv, head_dim,
        query_stride_t, query_stride_h, out_stride_t, out_stride_h,
        cache_stride_block, cache_stride_row, cache_stride_h, block_table_stride,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        TRANS_K: tl.constexpr, HEAVY_FIRST: tl.constexpr,
        SEARCH_BLOCK: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr):
    # Consecutive programs take the same query tile for every KV head; with HEAVY_FIRST the tiles
    # run from the highest number down, so the long rows at the end of a prompt start first and
    # the short ones fill the tail of the launch.
    program = tl.program_id(0)
    kv_head = program % num_kv_heads
    tile = program // num_kv_heads
    if HEAVY_FIRST:
        tile = tl.num_programs(0) // num_kv_heads - 1 - tile

    # The sequence owning this tile: the last i with query_start_loc[i] // BLOCK_Q + i <= tile (an
    # increasing function of i), found by counting in SEARCH_BLOCK-wide vector loads: one memory
    # round trip per SEARCH_BLOCK sequences instead of a chain of log2(batch) dependent loads.
    seq = tile * 0 - 1
    for start in range(0, num_seqs, SEARCH_BLOCK):
        candidates = start + tl.arange(0, SEARCH_BLOCK)
        in_batch = candidates < num_seqs
        starts = tl.load(query_start_loc_ptr + candidates, mask=in_batch, other=0)
        seq += tl.sum(((starts // BLOCK_Q + candidates <= tile) & in_batch).to(tl.int32), 0)
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
    k_base = k_cache_ptr + kv_head * cache_stride_h
    v_base = v_cache_ptr + kv_head * cache_stride_h
    # Keys before the tile's first query position are visible to every row: no mask needed.
    # Both loops start at key 0 or continue from it, so every row's running max is finite after
    # the first tile (key 0 is visible to all rows) and no -inf - -inf NaN can arise.
    unmasked_end = (context_len + first_token + 1) // BLOCK_N * BLOCK_N
    kv_end = context_len + tl.minimum(first_token + BLOCK_Q, query_len)
    unmasked_start = 0
    if USE_WINDOW:
        # Start at the tile holding the first row's oldest visible key; keys from the last row's
        # oldest visible key on are inside every row's window, so unmasked tiles start at or after it.
        # (A row that sees nothing in the first tiles is handled in _attention_tile.)
        kv_lo = tl.maximum(context_len + first_token - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
        all_rows_lo = tl.maximum(kv_end - sliding_window, 0)
        unmasked_start = kv_lo + (all_rows_lo - kv_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        unmasked_start = tl.minimum(unmasked_start, unmasked_end)
        for kv_start in range(kv_lo, unmasked_start, BLOCK_N):
            acc, m_i, l_i = _attention_tile(
                acc, m_i, l_i, q, k_base, v_base, block_table, kv_start, kv_end,
                query_positions, dims, dim_mask, qk_scale, softcap_scale, sliding_window,
                cache_stride_block, cache_stride_row, True, EVEN_D, TRANS_K, BLOCK_SIZE, BLOCK_N,
                DOT_PRECISION, UPCAST, SOFTCAP, USE_WINDOW)
    for kv_start in range(unmasked_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attention_tile(
            acc, m_i, l_i, q, k_base, v_base, block_table, kv_start, kv_end,
            query_positions, dims, dim_mask, qk_scale, softcap_scale, sliding_window,
            cache_stride_block, cache_stride_row, False, EVEN_D, TRANS_K, BLOCK_SIZE, BLOCK_N,
            DOT_PRECISION, UPCAST, SOFTCAP, USE_WINDOW)
    for kv_start in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attention_tile(
            acc, m_i, l_i, q, k_base, v_base, block_table, kv_start, kv_end,
            query_positions, dims, dim_mask, qk_scale, softcap_scale, sliding_window,
            cache_stride_block, cache_stride_row, True, EVEN_D, TRANS_K, BLOCK_SIZE, BLOCK_N,
            DOT_PRECISION, UPCAST, SOFTCAP, USE_WINDOW)

    # An empty context (a padding row with seq_len 0) yields zeros, as in the reference.
    out = acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token_rows[:, None] * out_stride_t + heads[:, None] * out_stride_h
             + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & dim_mask[None, :])


class PrefillConfig(NamedTuple):
    """Launch shape: query rows x heads per tile, keys per tile, warps, pipeline stages, whether K/V
    the K tile is loaded like V (keys x dims) and transposed, and whether the heaviest query tiles
    run first."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    trans_k: bool = False
    heavy_first: bool = True


def _tile_config(head_dim: int, dtype: torch.dtype, max_query_len: int | None) -> PrefillConfig:
    """Measured on an H100 in bf16, 32 query / 8 KV heads, head_dim 128, 16-token pages, sweeping
    rows 16-128 x keys 32-128 x 4/8 warps x 2-4 stages (bench/prefill_attention_sweep.py): one
    warpgroup on 64 rows (16 tokens x 4 heads) led both prompt shapes, with 32-key tiles and K
    loaded key-major at 8 x 512 (0.087 ms; 64-key tiles 0.091) and 64-key tiles at 1 x 4096
    (0.39 ms; 32-key 0.41-0.44, the classic 128 x 128 tile on 8 warps 0.40). For a few queries per
    sequence (k + 1 verification, 64 x 4,096 context x 6) 32-row tiles with 128 keys and 3 stages
    stream K/V at 2.9 TB/s (0.372 ms; the 64x64 tiles 0.381, 64x32 0.46). Two stages beat three
    for 64-row tiles; heaviest-first ordering gained 2-5%; Triton's warp specialization does not
    compile for this kernel on Hopper (Triton 3.6). fp32 and wide heads take smaller tiles."""
    if dtype == torch.float32 or head_dim > 128:
        return PrefillConfig(64, 32, 4, 2)
    if max_query_len is not None and max_query_len <= 16:
        return PrefillConfig(32, 128, 4, 3)
    if max_query_len is not None and max_query_len <= 1024:
        return PrefillConfig(64, 32, 4, 2, trans_k=True)
    return PrefillConfig(64, 64, 4, 2)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float,
                            max_query_len: int | None = None, block_m: int | None = None,
                            block_n: int | None = None,
                            config: PrefillConfig | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> output of the same shape (rows not covered by
    `query_start_loc` are left unwritten). `max_query_len` (a host-side hint, e.g. the metadata's)
    only picks the tile shape; `config` replaces that choice (benchmarks) and `block_m` (query rows
    x heads per tile) and `block_n` override its tile sizes, powers of two, for tests. The cache has
    the query's dtype, or is fp8 read as stored * k_scale (keys) and stored * v_scale (values).
    `sliding_window` W: a row at position p sees keys p - W < k <= p only; `logits_soft_cap` c:
    scores s become c * tanh(s / c) (None: off)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert k_cache.dtype == v_cache.dtype in (query.dtype, torch.float8_e4m3fn)
    if k_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0   # as in the reference: only an fp8 cache is scaled
    assert k_cache.stride() == v_cache.stride() and query.stride(2) == 1 and k_cache.stride(3) == 1
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_queries_per_kv = num_heads // num_kv_heads
    config = config or _tile_config(head_dim, query.dtype, max_query_len)
    block_m = block_m or config.block_m
    block_n = block_n or config.block_n
    group_pad = triton.next_power_of_2(num_queries_per_kv)
    block_q = max(1, block_m // group_pad)
    # tl.dot needs at least 16 rows; a wide group with a tiny block_m still gets them.
    block_q = max(block_q, triton.cdiv(16, group_pad))
    block_d = triton.next_power_of_2(head_dim)
    # Tiles are numbered per KV head, heads varying fastest (see the kernel).
    grid = ((num_tokens // block_q + num_seqs) * num_kv_heads,)
    qk_scale, softcap_scale = score_scales(scale, k_scale, logits_soft_cap)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        qk_scale, v_scale, softcap_scale, sliding_window or 0,
        num_seqs, num_kv_heads, num_queries_per_kv, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, GROUP_PAD=group_pad, BLOCK_N=block_n,
        BLOCK_D=block_d, EVEN_D=block_d == head_dim,
        TRANS_K=config.trans_k, HEAVY_FIRST=config.heavy_first, SEARCH_BLOCK=SEARCH_BLOCK,
        DOT_PRECISION=_dot_precision(query.dtype), UPCAST=_upcast_dot(query.dtype),
        SOFTCAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
