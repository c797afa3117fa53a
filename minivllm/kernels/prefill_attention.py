"""Paged varlen attention for prefill, chunked prefill, prefix-cache hits and mixed batches.

Reference: `minivllm.attention.torch_backend.paged_attention_reference`. Each sequence's query rows
are its last `q_len` tokens; they attend causally to the cached prefix and to themselves. The prefix
is read through the block table; the chunk's own keys either also through it (this step's K/V must
already be written to the cache) or, when the caller passes this step's `key`/`value` and the tile
table asks for it, from those contiguous tensors (by pointer, or as TMA tensor-descriptor tiles):
then a fresh prompt is a plain varlen attention whose key rows need no page lookups. Each source
is swept in its own tile loops, counted from its first key. On Hopper, given the step's query-tile
plan, the sequences with long query runs go to `prefill_attention_sm90` instead and this kernel takes
the rest of the step.

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
from triton.tools.tensor_descriptor import TensorDescriptor

from minivllm.kernels.decode_attention import _dot, _dot_precision, _tanh, _upcast_dot, score_scales

SEARCH_BLOCK = 64   # sequences whose query offsets a program scans per vector load


@triton.jit
def _attention_tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, desc_column, block_table,
                    key_row_offset, key_stride_t,
                    kv_start, kv_end, query_positions, dims, dim_mask, qk_scale, softcap_scale,
                    sliding_window, cache_stride_block, cache_stride_row,
                    MASKED: tl.constexpr, PAGED: tl.constexpr, TMA: tl.constexpr,
                    EVEN_D: tl.constexpr,
                    TRANS_K: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr):
    positions = kv_start + tl.arange(0, BLOCK_N)
    valid = positions < kv_end
    if TMA and not PAGED:
        # Tensor-descriptor (TMA) tiles of this step's K/V, [N, D] at row p + key_row_offset. Rows
        # past this sequence's keys hold other tokens (zeros past the tensor): masked below.
        desc_row = kv_start + key_row_offset
        k = tl.trans(k_desc.load([desc_row, desc_column]))                        # [D, N]
    else:
        if PAGED:
            if MASKED:
                pages = tl.load(block_table + positions // BLOCK_SIZE, mask=valid, other=0)
            else:
                pages = tl.load(block_table + positions // BLOCK_SIZE)
            rows = pages.to(tl.int64) * cache_stride_block + (positions % BLOCK_SIZE) * cache_stride_row
        else:   # this step's contiguous K/V: position p is row p + key_row_offset
            rows = (positions + key_row_offset).to(tl.int64) * key_stride_t
        v_ptrs = v_base + rows[:, None] + dims[None, :]                            # [N, D]
        if TRANS_K:
            k_ptrs = k_base + rows[:, None] + dims[None, :]                        # [N, D]
            k_mask = valid[:, None] & dim_mask[None, :]
            kd_mask = dim_mask[None, :]
        else:
            k_ptrs = k_base + rows[None, :] + dims[:, None]                        # [D, N]
            k_mask = valid[None, :] & dim_mask[:, None]
            kd_mask = dim_mask[:, None]
        # Tiles below the diagonal hold only valid keys: their loads need no mask at all.
        if MASKED:
            k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=kd_mask, other=0.0)
        if TRANS_K:
            k = tl.trans(k)
    k = k.to(q.dtype)   # an fp8 cache widens here (exactly); a no-op otherwise
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
    if TMA and not PAGED:
        v = v_desc.load([desc_row, desc_column])
        if MASKED:   # p is 0 there, but another token's row need not be finite
            v = tl.where(valid[:, None], v, 0.0)
    elif MASKED:
        v = tl.load(v_ptrs, mask=valid[:, None] & dim_mask[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=dim_mask[None, :], other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _attend_keys(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, desc_column, block_table,
                 key_row_offset, key_stride_t,
                 base, end, first_position, last_position, query_positions, dims, dim_mask,
                 qk_scale, softcap_scale, sliding_window, cache_stride_block, cache_stride_row,
                 PAGED: tl.constexpr, TMA: tl.constexpr, EVEN_D: tl.constexpr, TRANS_K: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr):
    """Keys at positions [base, end) in BLOCK_N-key tiles counted from `base`, for query rows at
    positions first_position..last_position. Tiles wholly at or before the first row's position
    (and, with a window, inside every row's window) run without masks; the rest are masked.
    Without a window the first tile holds a key every row sees (so no running max stays -inf);
    with one, _attention_tile guards rows that have seen nothing yet."""
    span = tl.maximum(tl.minimum(end, first_position + 1) - base, 0)
    unmasked_hi = base + span // BLOCK_N * BLOCK_N
    lo = base
    unmasked_lo = base
    if USE_WINDOW:
        # From the tile holding the first row's oldest visible key; keys from the last row's oldest
        # visible key on are inside every row's window.
        lo = base + tl.maximum(first_position - sliding_window + 1 - base, 0) // BLOCK_N * BLOCK_N
        all_rows_lo = tl.maximum(last_position - sliding_window + 1, lo)
        unmasked_lo = lo + (all_rows_lo - lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        unmasked_lo = tl.minimum(unmasked_lo, unmasked_hi)
        for kv_start in range(lo, unmasked_lo, BLOCK_N):
            acc, m_i, l_i = _attention_tile(
                acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, desc_column, block_table,
                key_row_offset, key_stride_t,
                kv_start, end, query_positions, dims, dim_mask, qk_scale, softcap_scale,
                sliding_window, cache_stride_block, cache_stride_row, True, PAGED, TMA, EVEN_D, TRANS_K,
                BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST, SOFTCAP, USE_WINDOW)
    for kv_start in range(unmasked_lo, unmasked_hi, BLOCK_N):
        acc, m_i, l_i = _attention_tile(
            acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, desc_column, block_table,
            key_row_offset, key_stride_t,
            kv_start, end, query_positions, dims, dim_mask, qk_scale, softcap_scale,
            sliding_window, cache_stride_block, cache_stride_row, False, PAGED, TMA, EVEN_D, TRANS_K,
            BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST, SOFTCAP, USE_WINDOW)
    # (With a window wholly past these keys, lo > unmasked_hi and only [lo, end) is left.)
    for kv_start in range(tl.maximum(unmasked_hi, lo), end, BLOCK_N):
        acc, m_i, l_i = _attention_tile(
            acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, desc_column, block_table,
            key_row_offset, key_stride_t,
            kv_start, end, query_positions, dims, dim_mask, qk_scale, softcap_scale,
            sliding_window, cache_stride_block, cache_stride_row, True, PAGED, TMA, EVEN_D, TRANS_K,
            BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST, SOFTCAP, USE_WINDOW)
    return acc, m_i, l_i


# Batch size and block-table width change every step; specialising on them would recompile mid-run.
@triton.jit(do_not_specialize=["num_seqs", "block_table_stride", "long_query_len"])
def _prefill_kernel(
        query_ptr, k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, k_desc, v_desc, out_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, plan_ptr,
        qk_scale, v_scale, softcap_scale, sliding_window, long_query_len,
        num_seqs, num_kv_heads, num_queries_per_kv, head_dim,
        query_stride_t, query_stride_h, out_stride_t, out_stride_h,
        cache_stride_block, cache_stride_row, cache_stride_h, key_stride_t, key_stride_h,
        block_table_stride, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        TRANS_K: tl.constexpr, HEAVY_FIRST: tl.constexpr, CONTIGUOUS_KV: tl.constexpr,
        TMA: tl.constexpr, PLANNED: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr):
    if PLANNED:   # the Hopper kernel's plan counts the sequences left here: none, nothing to search
        if tl.load(plan_ptr + 1) == 0:
            return
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
    # A surplus program (its sequence has fewer tiles than the bound), or a sequence the Hopper kernel
    # takes in the same step.
    if first_token >= query_len or query_len >= long_query_len:
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
    # Positions of the tile's first and last query rows; a padding sequence with an empty context
    # (seq_len 0, context_len -1) gets no keys at all.
    first_position = context_len + first_token
    last_position = context_len + tl.minimum(first_token + BLOCK_Q, query_len) - 1
    chunk_start = tl.maximum(context_len, 0)
    kv_end = tl.where(context_len < 0, 0, last_position + 1)
    if CONTIGUOUS_KV:
        # The cached prefix through the block table (every row sees all of it), then this step's
        # keys from the contiguous K/V tensors: position p is row p - context_len + query_start.
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, kv_head * head_dim, block_table, 0, 0,
            0, chunk_start, first_position, last_position, query_positions, dims,
            dim_mask, qk_scale, softcap_scale, sliding_window, cache_stride_block, cache_stride_row,
            True, TMA, EVEN_D, TRANS_K, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST, SOFTCAP, USE_WINDOW)
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, key_ptr + kv_head * key_stride_h, value_ptr + kv_head * key_stride_h,
            k_desc, v_desc, kv_head * head_dim, block_table, query_start - context_len, key_stride_t,
            chunk_start, kv_end, first_position, last_position, query_positions, dims,
            dim_mask, qk_scale, softcap_scale, sliding_window, cache_stride_block, cache_stride_row,
            False, TMA, EVEN_D, TRANS_K, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST, SOFTCAP, USE_WINDOW)
    else:
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, kv_head * head_dim, block_table, 0, 0,
            0, kv_end, first_position, last_position, query_positions, dims,
            dim_mask, qk_scale, softcap_scale, sliding_window, cache_stride_block, cache_stride_row,
            True, TMA, EVEN_D, TRANS_K, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST, SOFTCAP, USE_WINDOW)

    # An empty context (a padding row with seq_len 0) yields zeros, as in the reference.
    out = acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token_rows[:, None] * out_stride_t + heads[:, None] * out_stride_h
             + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & dim_mask[None, :])


class PrefillConfig(NamedTuple):
    """Launch shape: query rows x heads per tile, keys per tile, warps, pipeline stages, whether
    the K tile is loaded like V (keys x dims) and transposed, whether the heaviest query tiles run
    first, whether this step's keys are read from the contiguous K/V tensors when given, and
    whether those are loaded through tensor descriptors (TMA; where the layout allows)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    trans_k: bool = False
    heavy_first: bool = True
    contiguous_kv: bool = True
    tma: bool = False


def _tile_config(head_dim: int, dtype: torch.dtype, max_query_len: int | None) -> PrefillConfig:
    """Measured on an H100 in bf16, 32 query / 8 KV heads, head_dim 128, 16-token pages, against
    cuDNN's SDPA (bench/kernels/prefill_attention_sweep.py). Long prompts (1 x 4096): four warpgroups on
    256 rows (64 tokens x 4 heads), 64-key tiles, 3 stages, this step's keys through TMA
    descriptors: 0.321 ms (81% of SDPA's 0.259) against 0.401 for the former 64 x 64 tiles through
    the pages; the same tiles through the pages 0.362, 128 rows on 8 warps 0.336-0.344 (either
    source), 128 x 128 0.348. Short prompts (8 x 512): 64 rows, 32-key tiles, K loaded key-major,
    through the pages: 0.089 ms (63%); nothing measured beat it (128 x 64 x 3 stages 0.099; the
    TMA or contiguous-pointer chunk 0.10-0.15: small tiles gain nothing from it). A few queries
    per sequence (k + 1 verification, 64 x 4,096 context x 6): 32-row tiles with 128 keys and 3
    stages stream K/V at 2.9 TB/s through the pages (0.372 ms; reading the 6 own keys from the
    contiguous K/V adds a tile: 0.435). Heaviest-first ordering gained 12-21% on the long prompt.
    Measured and not used:
    one query head per program, as Triton's fused-attention tutorial lays it out (GQA not folded,
    K/V re-read from L2 per head): 8 x 512 at best 0.097 ms (64 x 64, 3 stages), 128 x 64 or
    128 x 128 on 8 warps 0.109-0.119; 1 x 4096 at best 0.342 (128 x 64) against 0.320 folded.
    Triton 3.6's warp-specialized key loop compiles for 8- and 16-warp tiles (4-warp ones trip an
    assertion in its pass) and gains nothing (256 x 64: 0.321; per-head 128 x 128: 0.346). The
    rescaled output as the P.V dot's accumulator: unchanged (0.089 / 0.320). Also not used: narrow
    tiles at the diagonal (one 16- or 32-key masked tile per query tile under 64/128-key tiles):
    8 x 512 at best 0.092 ms (64 x 64, 16-key diagonal), 1 x 4096 128 x 128
    with a 32-key diagonal 0.337; 256 x 64 with 4 stages 0.325; 256 x 128 does not fit shared
    memory at 3 stages and takes 4.3 ms at 2. fp32 and wide heads take smaller tiles."""
    if dtype == torch.float32 or head_dim > 128:
        return PrefillConfig(64, 32, 4, 2)
    if max_query_len is not None and max_query_len <= 16:
        return PrefillConfig(32, 128, 4, 3, contiguous_kv=False)
    if max_query_len is not None and max_query_len <= 1024:
        return PrefillConfig(64, 32, 4, 2, trans_k=True, contiguous_kv=False)
    return PrefillConfig(256, 64, 16, 3, tma=True)


def _descriptor_compatible(key: torch.Tensor, block_d: int) -> bool:
    """A TMA descriptor over [tokens, kv_heads * head_dim] needs heads packed, a power-of-two head
    dim, and 16-byte aligned base and row stride."""
    size = key.element_size()
    return (key.shape[2] == block_d and key.stride(1) == key.shape[2]
            and key.data_ptr() % 16 == 0 and key.stride(0) * size % 16 == 0)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float,
                            max_query_len: int | None = None, min_query_len: int | None = None,
                            block_m: int | None = None,
                            block_n: int | None = None,
                            config: PrefillConfig | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None, key: torch.Tensor | None = None,
                            value: torch.Tensor | None = None,
                            query_tile_plan: torch.Tensor | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> output of the same shape (rows not covered by
    `query_start_loc` are left unwritten). `max_query_len` (a host-side hint, e.g. the metadata's)
    only picks the tile shape, and `min_query_len` (another, or None) only spares a launch; `config`
    replaces that choice (benchmarks) and `block_m` (query rows
    x heads per tile) and `block_n` override its tile sizes, powers of two, for tests. The cache has
    the query's dtype, or is fp8 read as stored * k_scale (keys) and stored * v_scale (values).
    `sliding_window` W: a row at position p sees keys p - W < k <= p only; `logits_soft_cap` c:
    scores s become c * tanh(s / c) (None: off). `key`/`value` [num_tokens, num_kv_heads, head_dim]:
    this step's K/V as written into the cache; given (and the cache not fp8, whose rounding the
    reference sees), the keys inside each query chunk are read from them instead of the pages.
    `query_tile_plan`: the step's `prefill_attention_sm90.plan_query_tiles`, built once per step by the
    caller; given, with `key`/`value` and no per-layer option, the sequences of at least
    `prefill_attention_sm90.MIN_QUERY_LEN` query rows go to the Hopper kernel where it runs, and this
    kernel takes the rest of the step; `config`, `block_m` or `block_n` keep the whole step here."""
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
    hopper_plan = None   # the plan, once the Hopper kernel has taken the sequences it lists
    long_query_len = 1 << 30   # sequences with this many query rows or more are another kernel's
    if (query_tile_plan is not None and key is not None and config is None and block_m is None
            and block_n is None and sliding_window is None and logits_soft_cap is None):
        from minivllm.kernels import prefill_attention_sm90 as sm90   # Gluon: compiled for Hopper only
        if sm90.supported(query, key, value, k_cache, v_cache):
            sm90.prefill_attention(query, key, value, k_cache, v_cache, block_tables, query_tile_plan, scale,
                                   out=out)
            if min_query_len is not None and min_query_len >= sm90.MIN_QUERY_LEN:
                return out
            hopper_plan, long_query_len = query_tile_plan, sm90.MIN_QUERY_LEN
            if max_query_len is not None:   # this kernel's tile shape is for the short rows it has left
                max_query_len = min(max_query_len, long_query_len - 1)
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
    contiguous_kv = config.contiguous_kv and key is not None and k_cache.dtype == query.dtype
    if contiguous_kv:
        assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim)
        if key.stride() != value.stride() or key.stride(2) != 1:
            key, value = key.contiguous(), value.contiguous()
    else:
        key, value = k_cache, v_cache   # unused
    k_desc = v_desc = None
    if contiguous_kv and config.tma and all(_descriptor_compatible(x, block_d) for x in (key, value)):
        k_desc, v_desc = (TensorDescriptor(x, [num_tokens, num_kv_heads * head_dim], [x.stride(0), 1],
                                           [block_n, head_dim]) for x in (key, value))
    _prefill_kernel[grid](
        query, k_cache, v_cache, key, value, k_desc, v_desc, out, block_tables, seq_lens, query_start_loc,
        hopper_plan, qk_scale, v_scale, softcap_scale, sliding_window or 0, long_query_len,
        num_seqs, num_kv_heads, num_queries_per_kv, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        key.stride(0) if contiguous_kv else 0, key.stride(1) if contiguous_kv else 0,
        block_tables.stride(0), BLOCK_SIZE=block_size, BLOCK_Q=block_q, GROUP_PAD=group_pad, BLOCK_N=block_n,
        BLOCK_D=block_d, EVEN_D=block_d == head_dim,
        TRANS_K=config.trans_k, HEAVY_FIRST=config.heavy_first,
        CONTIGUOUS_KV=contiguous_kv, TMA=k_desc is not None, PLANNED=hopper_plan is not None,
        SEARCH_BLOCK=SEARCH_BLOCK,
        DOT_PRECISION=_dot_precision(query.dtype), UPCAST=_upcast_dot(query.dtype),
        SOFTCAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
