"""Paged decode attention: one query token per sequence, attending over its whole cached context.

Reference: `minivllm.attention.torch_backend.paged_attention_reference` (with every query length 1).
This module owns the decode kernels only; the KV write and the varlen prefill live beside it.

Design:
- GQA-aware: one program serves all query heads of one KV head, so each K/V tile is loaded once per
  group and the group's heads form the M dimension of a small matrix product.
- Split-K ("flash-decoding"): the context is cut into partitions handled by separate programs, each
  writing its running max, softmax sum and normalised partial output; a second kernel combines them.
  This keeps the GPU busy when batch x kv_heads is small. Each sequence's partition size follows its
  own length (`sequence_partition_size`), so a short context in a graph captured for long ones is still
  cut finely (a 600-token context at batch 1: 8.5 instead of 12.5 us a layer on an H100,
  bench/results/decode_split_h100.json).
- fp8 caches (float8_e4m3fn) are loaded at one byte per element and widened to the query's dtype in
  registers (exact: every e4m3 value is a bf16 value); the per-layer scales are folded into the
  softmax scale (keys) and the output (values), so dequantizing costs no extra multiply per element.
- Per-layer options, compiled in only when used (constexpr flags): a sliding window starts the key
  loop at seq_len - W (split-K partitions wholly before it write an empty partial result), and a
  logit soft cap maps each score s to c * tanh(s / c) before the softmax.
- CUDA-graph safe: no host syncs, and the grids depend only on shapes (batch, kv heads and a split
  count derived from them and `block_tables.shape[1]`, the most blocks any sequence can own); programs
  whose partition starts past their sequence's length exit at once.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import launch_options, wait_for_previous

LOG2_E = 1.4426950408889634
MIN_PARTITION_SIZE = 64    # tokens: one key tile (BLOCK_N) per program at the finest split
PROGRAMS_PER_SM = 2        # split until batch x kv_heads x splits reaches this many programs per SM
LONG_PARTITION_SIZE = 1024  # tokens: the shortest partition once batch x kv_heads gives every SM a program
# With fewer splits than this, a partition of a few hundred tokens spans several 64-key tiles, a loop of dependent
# loads; at head_dim 64 one 128-key tile holds the bytes of a 64-key tile at head_dim 128. SmolLM2-135M's decode
# graphs at a 400-token context on an H200: 8, 16, 32, 48 and 64 rows 704, 709, 768, 959 and 981 us against 708, 741,
# 840, 1,071 and 1,084 with 64-key tiles, 1 to 4 rows unchanged (decode_ab_h200.json `wide_key_tiles`).
WIDE_TILE_SPLITS = 16


@triton.jit
def _partition_size(seq_len, splits, fixed_partition, min_partition):
    """`sequence_partition_size` on the device, or the forced size when there is one (> 0)."""
    partition = seq_len * 0 + min_partition
    while partition * splits < seq_len:
        partition *= 2
    return tl.where(fixed_partition > 0, fixed_partition, partition)


@triton.jit
def _tanh(x):
    # From exp2, which every Triton backend and the interpreter have: tanh(x) = 1 - 2 / (e^2x + 1),
    # saturating to +-1 (exp2 overflows to inf or underflows to 0) instead of producing NaN.
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)   # 2 * log2(e)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Triton 3.6's interpreter multiplies bf16 blocks as their raw uint16 bits; when interpreting,
    # multiply in fp32 instead (UPCAST is never set for compiled kernels).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


# The block-table width changes every step in eager mode; specialising on it would recompile mid-run.
@triton.jit(do_not_specialize=["block_table_stride"])
def _decode_partition_kernel(
        query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
        qk_scale, v_scale, softcap_scale, sliding_window, num_queries_per_kv, head_dim,
        query_stride_t, query_stride_h, out_stride_t, out_stride_h,
        cache_stride_block, cache_stride_row, cache_stride_h, block_table_stride,
        partial_stride_seq, partial_stride_head, fixed_partition, min_partition,
        SPLIT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)   # before the early return below too (see kernels/pdl.py)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = 1
    if SPLIT:
        partition = _partition_size(seq_len, tl.num_programs(2), fixed_partition, min_partition)
        num_used = (seq_len + partition - 1) // partition
        start = split * partition
        if start >= seq_len:  # this partition lies past the context: no work, nothing written
            return
        end = tl.minimum(start + partition, seq_len)
    else:
        start = 0
        end = seq_len
    if USE_WINDOW:   # the query (position seq_len - 1) sees the last `sliding_window` keys only
        start = tl.maximum(start, seq_len - sliding_window)

    group = tl.arange(0, BLOCK_G)
    heads = kv_head * num_queries_per_kv + group
    head_mask = group < num_queries_per_kv
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(query_ptr + seq.to(tl.int64) * query_stride_t + heads[:, None] * query_stride_h
                + dims[None, :], mask=head_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)   # running max of scores (log2 units)
    l_i = tl.zeros([BLOCK_G], tl.float32)                  # running softmax denominator
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = positions < end
        # Gather token rows through the block table; a tile may span several pages.
        pages = tl.load(block_table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = pages * cache_stride_block + (positions % BLOCK_SIZE) * cache_stride_row \
            + kv_head * cache_stride_h
        k = tl.load(k_cache_ptr + rows[None, :] + dims[:, None],
                    mask=valid[None, :] & dim_mask[:, None], other=0.0).to(q.dtype)  # [D, N]
        scores = _dot(q, k, DOT_PRECISION, UPCAST)                                # [G, N]
        if SOFTCAP:   # tanh of the scaled score; qk_scale then holds cap * log2(e)
            scores = _tanh(scores * softcap_scale)
        scores = scores * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :],
                    mask=valid[:, None] & dim_mask[None, :], other=0.0).to(q.dtype)  # [N, D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new

    acc = acc * v_scale   # the values' dequantization scale, once per output instead of per element
    out_mask = head_mask[:, None] & dim_mask[None, :]
    if SPLIT and num_used > 1:
        # Normalised partial output plus (max, sum): the reduction reweights partitions exactly.
        base = seq.to(tl.int64) * partial_stride_seq + heads * partial_stride_head + split
        tl.store(partial_max_ptr + base, m_i, mask=head_mask)
        tl.store(partial_sum_ptr + base, l_i, mask=head_mask)
        if USE_WINDOW:   # a partition wholly before the window saw no key: zeros, weight 0
            l_i_safe = tl.where(l_i > 0, l_i, 1.0)
        else:
            l_i_safe = l_i
        tl.store(partial_out_ptr + base[:, None] * head_dim + dims[None, :],
                 acc / l_i_safe[:, None], mask=out_mask)
    else:
        # A context in one partition is the output itself (the reduction skips it). An empty context
        # (padding row) yields zeros, as the reference does.
        denominator = tl.where(l_i > 0, l_i, 1.0)
        out = acc / denominator[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * out_stride_t + heads[:, None] * out_stride_h
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
        out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, seq_lens_ptr,
        head_dim, out_stride_t, out_stride_h, partial_stride_seq, partial_stride_head, splits, fixed_partition,
        min_partition, MAX_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    partition = _partition_size(seq_len, splits, fixed_partition, min_partition)
    num_used = (seq_len + partition - 1) // partition   # only these were written
    if num_used == 1:   # the partition kernel wrote the output
        return
    base = seq.to(tl.int64) * partial_stride_seq + head * partial_stride_head
    split_ids = tl.arange(0, MAX_SPLITS)
    used = split_ids < num_used
    maxes = tl.load(partial_max_ptr + base + split_ids, mask=used, other=float("-inf"))
    sums = tl.load(partial_sum_ptr + base + split_ids, mask=used, other=0.0)
    global_max = tl.where(num_used > 0, tl.max(maxes, 0), 0.0)   # no -inf - -inf when empty
    weights = tl.where(used, tl.math.exp2(maxes - global_max) * sums, 0.0)
    total = tl.sum(weights, 0)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    # All partitions' rows in one load (a loop over them would be a chain of dependent loads)
    partials = tl.load(partial_out_ptr + (base + split_ids)[:, None] * head_dim + dims[None, :],
                       mask=used[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(weights[:, None] * partials, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * out_stride_t + head * out_stride_h + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: any small number keeps split decisions realistic


def shortest_partition(batch: int, num_kv_heads: int, num_sms: int, min_partition: int = MIN_PARTITION_SIZE) -> int:
    """The fewest tokens a partition holds: one key tile while the SMs lack (sequence, KV head) programs, and
    LONG_PARTITION_SIZE once batch x kv_heads gives each SM one. There cutting a short context buys no
    parallelism the SMs lack and costs the reduction, while a long one still gains from its halves being read
    side by side (decode_split_h200.json, Llama-3-8B's heads at batch 17 to 32: a 600-token context whole
    against in two, a 4,000-token one in two against whole)."""
    return LONG_PARTITION_SIZE if batch * num_kv_heads >= num_sms else min_partition


def choose_decode_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int,
                         min_partition: int = MIN_PARTITION_SIZE) -> int | None:
    """Split-K programs per (sequence, KV head): enough for PROGRAMS_PER_SM programs per SM, at most as many
    as partitions of `shortest_partition` tokens fit in `max_context`; None when that is one. Depends only on
    shapes, so a CUDA graph captured with it stays valid for any sequence lengths up to `max_context`; each
    sequence's partition then follows its own length (`sequence_partition_size`), and a sequence whose
    context fits one partition is written by the partition kernel alone."""
    programs = batch * num_kv_heads
    shortest = shortest_partition(batch, num_kv_heads, num_sms, min_partition)
    splits = min(triton.cdiv(PROGRAMS_PER_SM * num_sms, programs), triton.cdiv(max_context, shortest))
    return splits if splits > 1 else None


def sequence_partition_size(seq_len: int, splits: int, min_partition: int = MIN_PARTITION_SIZE) -> int:
    """Tokens per partition of one sequence: the smallest power of two (at least `min_partition`, one key
    tile) that cuts its context into at most `splits` partitions. Sized for the graph's longest context
    and never below 256 tokens, partitions would give a 600-token context at batch 1 three programs of four
    tiles each, a chain of dependent loads (12.5 us a layer on an H100, against 8.5 with this rule)."""
    partition = min_partition
    while partition * splits < seq_len:
        partition *= 2
    return partition


def split_key_tile(block_n: int, block_d: int, num_splits: int | None) -> int:
    """Keys per tile of a split decode: 128 instead of 64 at head_dims up to 64 when there are fewer than
    WIDE_TILE_SPLITS splits (see there), else `block_n`."""
    if num_splits is not None and num_splits < WIDE_TILE_SPLITS and block_d <= 64 and block_n == 64:
        return 128
    return block_n


def score_scales(scale: float, k_scale: float, logits_soft_cap: float | None) -> tuple[float, float]:
    """(qk_scale, softcap_scale) for the kernels: without a cap, scores are dot * qk_scale in log2 units
    (softcap_scale unused); with cap c, tanh(dot * softcap_scale) * qk_scale = c * tanh(s / c) * log2(e)."""
    if logits_soft_cap is None:
        return scale * LOG2_E * k_scale, 1.0
    return logits_soft_cap * LOG2_E, scale * k_scale / logits_soft_cap


def _dot_precision(dtype: torch.dtype) -> str:
    # Plain fp32 caches ask for exact fp32 products (tf32 would miss the reference by ~1e-3).
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def _decode_config(block_d: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(keys per tile, warps, pipeline stages). In a sweep on an H100 (head_dim 128, bf16) the best
    variants, 64 or 128 keys with 2-4 warps, were within 2% of each other at ~2.9 TB/s (batch 64 x
    4096 tokens; the device copies at 3.0 TB/s); 32-key tiles were clearly slower."""
    if block_d > 128 or dtype == torch.float32:
        return 32, 4, 2
    return 64, 4, 3


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           partition_size: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, sliding_window: int | None = None,
                           logits_soft_cap: float | None = None) -> torch.Tensor:
    """query [batch, num_heads, head_dim] (row i is sequence i's only query token) -> output of the
    same shape. `partition_size` (a power of two >= 16) forces split-K with that many tokens per
    partition; None splits by the shapes and each sequence's length (`choose_decode_splits`,
    `sequence_partition_size`); a value of at least `block_tables.shape[1] * block_size` disables the split.
    The cache has the query's dtype, or is fp8 read as stored * k_scale (keys) and stored * v_scale (values).
    `sliding_window` W: the query sees its last W positions only; `logits_soft_cap` c: scores s become
    c * tanh(s / c) (None: off)."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert k_cache.dtype == v_cache.dtype in (query.dtype, torch.float8_e4m3fn)
    if k_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0   # as in the reference: only an fp8 cache is scaled
    assert k_cache.stride() == v_cache.stride() and query.stride(2) == 1 and k_cache.stride(3) == 1
    assert block_tables.shape[0] == batch and seq_lens.shape == (batch,)
    out = torch.empty((batch, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    num_queries_per_kv = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    block_d = triton.next_power_of_2(head_dim)
    block_g = max(16, triton.next_power_of_2(num_queries_per_kv))   # tl.dot needs M >= 16
    block_n, num_warps, num_stages = _decode_config(block_d, query.dtype)
    min_partition = block_n
    if partition_size is None:   # per sequence, at least one key tile
        fixed_partition = 0
        num_sms = _num_sms(query.device)
        num_splits = choose_decode_splits(batch, num_kv_heads, max_context, num_sms, block_n)
        if (wide := split_key_tile(block_n, block_d, num_splits)) != block_n:
            block_n = wide
            num_splits = choose_decode_splits(batch, num_kv_heads, max_context, num_sms, block_n)
        min_partition = shortest_partition(batch, num_kv_heads, num_sms, block_n)
    elif partition_size >= max_context:
        fixed_partition, num_splits = 0, None
    else:
        assert partition_size >= 16 and partition_size & (partition_size - 1) == 0
        fixed_partition, num_splits = partition_size, triton.cdiv(max_context, partition_size)
        block_n = min(block_n, partition_size)
    split = num_splits is not None
    num_splits = num_splits or 1
    if split:
        partial_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                                  device=query.device)
        partial_max = torch.empty((batch, num_heads, num_splits), dtype=torch.float32,
                                  device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:  # unused by the kernel; any tensor satisfies the signature
        partial_out = partial_max = partial_sum = out
    qk_scale, softcap_scale = score_scales(scale, k_scale, logits_soft_cap)
    pdl = launch_options(query.device)
    _decode_partition_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens,
        out, partial_out, partial_max, partial_sum,
        qk_scale, v_scale, softcap_scale, sliding_window or 0, num_queries_per_kv, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_heads * num_splits, num_splits, fixed_partition, min_partition,
        SPLIT=split, BLOCK_SIZE=block_size,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(query.dtype), UPCAST=_upcast_dot(query.dtype),
        SOFTCAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None, **pdl,
        num_warps=num_warps, num_stages=num_stages)
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            out, partial_out, partial_max, partial_sum, seq_lens,
            head_dim, out.stride(0), out.stride(1), num_heads * num_splits, num_splits, num_splits, fixed_partition,
            min_partition, MAX_SPLITS=triton.next_power_of_2(num_splits), BLOCK_D=block_d, **pdl,
            num_warps=1 if block_d <= 64 else 4)
    return out
