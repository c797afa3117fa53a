"""Causal varlen attention of fresh prompts on Hopper (sm_90), warp-specialized, in Gluon.

The case it serves: every sequence of the step is a fresh prompt (no cached prefix), so its keys
are this step's contiguous K/V and the attention is a plain causal varlen FlashAttention. Anything
else (prefix hits, later chunks, verification, fp8 caches, windows, soft caps) stays with the
Triton kernel in `prefill_attention.py`, whose reference is also this kernel's
(`attention.torch_backend.paged_attention_reference`).

Why Gluon: Triton 3.6 schedules the softmax and the two matrix multiplies of a key tile one after
the other. This kernel lays out the FlashAttention-3 schedule by hand:
- one producer warp streams K and V tiles through a ring of shared-memory stages with TMA, each
  stage guarded by full/empty mbarriers (K and V apart, so QK^T starts before V lands);
- two consumer warpgroups own 64 query rows each of a 128-row tile (one query head) and share
  every K/V stage;
- inside a warpgroup the products are asynchronous wgmma: S_j = Q K_j^T and O += P_{j-1} V_{j-1}
  are issued together, and the softmax of S_j runs while P_{j-1} V_{j-1} is still on the tensor
  cores; O is rescaled once that product has landed.

Query tiles are numbered as in the Triton kernel (sequence i's from `query_start_loc[i] // BLOCK_M + i`,
found on device; surplus numbers are skipped), heaviest first, and a persistent grid of one program per
SM walks them, so one tile's epilogue overlaps the next tile's loads. Rows past a sequence's end read
other tokens' queries and are never stored; keys past a row's position are masked (causality
also hides the next sequence's keys that a tile may reach).
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from minivllm.kernels import prefill_attention
from minivllm.kernels.decode_attention import LOG2_E
from minivllm.kernels.split_k import num_sms

WG_ROWS = gl.constexpr(64)    # query rows per consumer warpgroup (one wgmma M)
BLOCK_M = gl.constexpr(128)   # query rows per program: two warpgroups
SEARCH_BLOCK = gl.constexpr(prefill_attention.SEARCH_BLOCK)
CONSUMER_REGS, PRODUCER_REGS = 240, 24   # registers per thread of the two partitions (setmaxnreg)


# Gluon's own sum/max/cdiv wrap triton.jit helpers, which turn into interpreter objects under
# TRITON_INTERPRET=1 (set for the CPU tests, which compile this kernel for sm_90); these do not.
@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _max(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _cdiv(a, b):
    return (a + b - 1) // b


@gluon.jit
def _tile_info(t, query_start_loc_ptr, num_seqs, num_heads, num_tiles_total):
    """Query tile t of the launch (heaviest first, heads fastest) -> (sequence start, length, first
    row, head); a surplus tile (its sequence has fewer) has first row >= length."""
    head = t % num_heads
    tile = num_tiles_total // num_heads - 1 - t // num_heads
    search_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    seq = tile * 0 - 1
    for start in range(0, num_seqs, SEARCH_BLOCK):
        candidates = start + gl.arange(0, SEARCH_BLOCK, layout=search_layout)
        in_batch = candidates < num_seqs
        starts = gl.load(query_start_loc_ptr + candidates, mask=in_batch, other=0)
        seq += gl.reduce(((starts // BLOCK_M + candidates <= tile) & in_batch).to(gl.int32), 0, _add)
    query_start = gl.load(query_start_loc_ptr + seq)
    query_len = gl.load(query_start_loc_ptr + seq + 1) - query_start
    first_row = (tile - (query_start // BLOCK_M + seq)) * BLOCK_M
    return query_start, query_len, first_row, head


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, query_start_loc_ptr,
              num_seqs, num_heads, num_queries_per_kv, num_tiles_total):
    # (Partition arguments arrive as values: shapes are read back from the buffers.)
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    q_full, q_empty, k_full, v_full, k_empty, v_empty = bars
    it = 0      # key tiles loaded so far: stage it % STAGES, round it // STAGES
    n = 0       # query tiles loaded so far
    for t in range(gl.program_id(0), num_tiles_total, gl.num_programs(0)):
        query_start, query_len, first_row, head = _tile_info(t, query_start_loc_ptr, num_seqs, num_heads,
                                                             num_tiles_total)
        if first_row < query_len:
            num_tiles = _cdiv(gl.minimum(first_row + BLOCK_M, query_len), BLOCK_N)
            kv_col = (head // num_queries_per_kv) * HEAD_DIM
            # The query buffer is free once both warpgroups issued their last QK^T of the last tile.
            mbarrier.wait(q_empty, (n & 1) ^ 1)
            mbarrier.expect(q_full, 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [query_start + first_row, head * HEAD_DIM], q_full,
                                            q_smem.index(0))
            tma.async_copy_global_to_shared(q_desc, [query_start + first_row + WG_ROWS, head * HEAD_DIM],
                                            q_full, q_smem.index(1))
            for j in range(num_tiles):
                stage = it % STAGES
                phase = (it // STAGES) & 1
                # A stage is free once both warpgroups released it (the first round passes at once).
                mbarrier.wait(k_empty.index(stage), phase ^ 1)
                mbarrier.expect(k_full.index(stage), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [query_start + j * BLOCK_N, kv_col],
                                                k_full.index(stage), k_smem.index(stage))
                mbarrier.wait(v_empty.index(stage), phase ^ 1)
                mbarrier.expect(v_full.index(stage), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [query_start + j * BLOCK_N, kv_col],
                                                v_full.index(stage), v_smem.index(stage))
                it += 1
            n += 1


@gluon.jit
def _masked_scores(s, tile, first_row, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Scores of keys after a row's own position set to -inf (only tiles that cross the
    diagonal of this warpgroup's rows pay for it)."""
    if tile * BLOCK_N + BLOCK_N - 1 > first_row:
        rows = first_row + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
        keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1)
        s = gl.where(visible, s, float("-inf"))
    return s


@gluon.jit
def _attend(q, k_smem, v_smem, k_full, v_full, k_empty, v_empty, it, first_row, my_tiles, qk_scale,
            s_layout: gl.constexpr, o_layout: gl.constexpr):
    """One warpgroup's 64 rows over key tiles 0..my_tiles-1 (ring positions it, it + 1, ...):
    returns the unnormalised output and the softmax denominators."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=o_layout)

    # Tile 0: no product of values in flight yet.
    stage = it % STAGES
    mbarrier.wait(k_full.index(stage), (it // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(stage), count=1)
    s = _masked_scores(s, 0, first_row, BLOCK_N, s_layout)
    m_i = gl.reduce(s, 1, _max) * qk_scale
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_i, 1))
    l_i = gl.reduce(p, 1, _add)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)

    for j in range(1, my_tiles):
        stage = (it + j) % STAGES
        prev = (it + j - 1) % STAGES
        mbarrier.wait(k_full.index(stage), ((it + j) // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_full.index(prev), ((it + j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        # wgmma groups retire in order: one outstanding means S is ready, P.V may still run.
        s = warpgroup_mma_wait(1, deps=(s,))
        mbarrier.arrive(k_empty.index(stage), count=1)
        s = _masked_scores(s, j, first_row, BLOCK_N, s_layout)
        m_new = gl.maximum(m_i, gl.reduce(s, 1, _max) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.reduce(p, 1, _add)
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)

    last = it + my_tiles - 1
    mbarrier.wait(v_full.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    return acc, l_i


@gluon.jit
def _consumer(wg, q_smem, k_smem, v_smem, o_smem, bars, o_desc, out_ptr, out_stride,
              query_start_loc_ptr, num_seqs, num_heads, num_tiles_total, qk_scale):
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    q_full, q_empty, k_full, v_full, k_empty, v_empty = bars
    q = q_smem.index(wg)
    o_buf = o_smem.index(wg)
    it = 0
    n = 0
    for t in range(gl.program_id(0), num_tiles_total, gl.num_programs(0)):
        query_start, query_len, tile_row, head = _tile_info(t, query_start_loc_ptr, num_seqs, num_heads,
                                                            num_tiles_total)
        if tile_row < query_len:
            num_tiles = _cdiv(gl.minimum(tile_row + BLOCK_M, query_len), BLOCK_N)
            first_row = tile_row + wg * WG_ROWS
            # Tiles this warpgroup's rows need; a warpgroup wholly past its sequence's end takes one.
            my_tiles = _cdiv(gl.minimum(first_row + WG_ROWS, query_len), BLOCK_N)
            if first_row >= query_len:
                my_tiles = 1
            mbarrier.wait(q_full, n & 1)
            acc, l_i = _attend(q, k_smem, v_smem, k_full, v_full, k_empty, v_empty, it, first_row,
                               my_tiles, qk_scale, s_layout, o_layout)
            mbarrier.arrive(q_empty, count=1)
            # Tiles only the other warpgroup needs: released once loaded (their full barrier having
            # fired, both warpgroups are done with the stage's previous round).
            for j in range(my_tiles, num_tiles):
                stage = (it + j) % STAGES
                mbarrier.wait(k_full.index(stage), ((it + j) // STAGES) & 1)
                mbarrier.arrive(k_empty.index(stage), count=1)
                mbarrier.wait(v_full.index(stage), ((it + j) // STAGES) & 1)
                mbarrier.arrive(v_empty.index(stage), count=1)
            it += num_tiles
            n += 1

            out = (acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)).to(
                o_desc.dtype)
            if first_row + WG_ROWS <= query_len:
                # A whole tile inside the sequence leaves through TMA, overlapping the next tile.
                tma.store_wait(0)
                o_buf.store(out)
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [query_start + first_row, head * HEAD_DIM], o_buf)
            else:
                rows = first_row + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, o_layout))
                dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
                offsets = (gl.expand_dims((query_start + rows).to(gl.int64) * out_stride, 1)
                           + gl.expand_dims(head * HEAD_DIM + dims, 0))
                gl.store(out_ptr + offsets, out, mask=gl.expand_dims(rows < query_len, 1))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["num_seqs", "num_tiles_total"])
def _fresh_prefill_kernel(q_desc, k_desc, v_desc, o_desc, out_ptr, query_start_loc_ptr, qk_scale,
                          num_seqs, num_heads, num_queries_per_kv, out_stride, num_tiles_total,
                          BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, WG_ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [2, WG_ROWS, HEAD_DIM], o_desc.layout)
    q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_full, count=1)
    mbarrier.init(q_empty, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()

    bars = (q_full, q_empty, k_full, v_full, k_empty, v_empty)
    consumer_args = (q_smem, k_smem, v_smem, o_smem, bars, o_desc, out_ptr, out_stride,
                     query_start_loc_ptr, num_seqs, num_heads, num_tiles_total, qk_scale)
    gl.warp_specialize([
        (_consumer, (0,) + consumer_args),
        (_consumer, (1,) + consumer_args),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, query_start_loc_ptr,
                     num_seqs, num_heads, num_queries_per_kv, num_tiles_total)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def fresh_prefill_supported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Hopper, 16-bit, head_dim 64 or 128, heads packed and rows 16-byte aligned (TMA)."""
    if not (query.is_cuda and _capability(query.device) == (9, 0)):
        return False
    head_dim = query.shape[-1]
    return (query.dtype in (torch.bfloat16, torch.float16) and key.dtype == value.dtype == query.dtype
            and head_dim in (64, 128)
            and all(x.stride(2) == 1 and x.stride(1) == head_dim and x.stride(0) * 2 % 16 == 0
                    and x.data_ptr() % 16 == 0 for x in (query, key, value)))


@functools.lru_cache(maxsize=None)
def _layout(rows: int, head_dim: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16 if dtype == torch.bfloat16
                                                else gl.float16)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def fresh_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, block_n: int = 128,
                            stages: int = 2, programs: int | None = None) -> torch.Tensor:
    """query [tokens, heads, D], key/value [tokens, kv_heads, D] of fresh prompts whose token
    ranges `query_start_loc` lists -> output [tokens, heads, D] (rows outside them unwritten)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    num_seqs = query_start_loc.shape[0] - 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    def descriptor(x, heads, rows):
        return TensorDescriptor(x, [num_tokens, heads * head_dim], [x.stride(0), 1], [rows, head_dim],
                                _layout(rows, head_dim, x.dtype))

    num_tiles_total = (num_tokens // BLOCK_M.value + num_seqs) * num_heads
    programs = programs or num_sms(query.device)
    _fresh_prefill_kernel[(min(programs, num_tiles_total),)](
        descriptor(query, num_heads, WG_ROWS.value), descriptor(key, num_kv_heads, block_n),
        descriptor(value, num_kv_heads, block_n), descriptor(out, num_heads, WG_ROWS.value), out,
        query_start_loc, scale * LOG2_E,
        num_seqs, num_heads, num_heads // num_kv_heads, out.stride(0), num_tiles_total,
        BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return out
