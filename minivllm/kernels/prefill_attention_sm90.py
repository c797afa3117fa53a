"""Causal varlen attention of prompt chunks on Hopper (sm_90), warp-specialized, in Gluon.

The case it serves: the sequences of a step with at least `MIN_QUERY_LEN` query rows (prompts, later
chunks of long prompts, prompts after a prefix-cache hit). Each attends to its cached prefix, read
through its block table, and causally to this step's own keys, read from the contiguous K/V the layer
just projected. Shorter query runs (decode rows and verification riding along) are the Triton kernel's
in `prefill_attention.py`, which runs beside this one in the same step and skips the long ones; so do
fp8 caches, windows and soft caps. Both kernels' reference is
`attention.torch_backend.paged_attention_reference`.

Why Gluon: Triton 3.6 schedules the softmax and the two matrix multiplies of a key tile one after
the other. This kernel lays out the FlashAttention-3 schedule by hand:
- one producer warp streams K and V tiles through a ring of shared-memory stages with TMA, each
  stage guarded by full/empty mbarriers (K and V apart, so QK^T starts before V lands); a tile of
  the prefix arrives as one TMA box per 16-token page and 64 columns, placed by the block table;
- two consumer warpgroups own 64 query rows each of a 128-row tile (one query head) and share
  every K/V stage; queries have two slots, so the next tile's load while this one runs;
- inside a warpgroup the products are asynchronous wgmma: S_j = Q K_j^T and O += P_{j-1} V_{j-1}
  are issued together, and the softmax of S_j runs while P_{j-1} V_{j-1} is still on the tensor
  cores; O is rescaled once that product has landed.

Which query tiles exist is decided once per step, on the device, by `plan_query_tiles` (one small
Triton kernel, so it is captured in CUDA graphs like the layers): a row per tile (sequence, offsets,
prefix length), heaviest first, which a persistent grid of one program per SM walks, heads fastest. Rows past a sequence's end
read other tokens' queries and are never stored; keys past a row's position are masked (causality
also hides the next sequence's keys that a tile may reach), and so are the prefix's last page's rows
past the prefix.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from minivllm.kernels.decode_attention import LOG2_E
from minivllm.kernels.split_k import num_sms

WG_ROWS = gl.constexpr(64)    # query rows per consumer warpgroup (one wgmma M)
BLOCK_M = gl.constexpr(128)   # query rows per program: two warpgroups
PAGE_COLUMNS = 64             # head dims per prefix TMA box: 128 bytes, the swizzle's width
PLAN_ROW = gl.constexpr(8)    # int32 fields per plan row: sequence, query start, length, prefix, first row
CONSUMER_REGS, PRODUCER_REGS = 240, 24   # registers per thread of the two partitions (setmaxnreg)
# Sequences with fewer query rows fill under half a 128-row tile of one head: the Triton kernel, which
# folds a KV head's query heads into its rows, serves them (decode rows, verification) better.
MIN_QUERY_LEN = 64


# Gluon's own sum/max/cdiv wrap triton.jit functions, which turn into interpreter objects under
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
def _tile(plan_ptr, t, num_heads):
    """Tile t of the step (plan rows heaviest first, heads fastest) -> (sequence, its first query token,
    query length, cached prefix length, the tile's first query row). Independent loads: one memory
    round trip."""
    row = plan_ptr + PLAN_ROW * (1 + t // num_heads)
    return gl.load(row), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4)


@gluon.jit
def _load_keys(desc, page_desc, block_table, tile, num_prefix_tiles, last_page, own_row, column, bar, dest):
    """Key tile `tile` of a query tile into `dest`: from the prefix's pages while tile < num_prefix_tiles
    (one TMA box per page and 64 columns), then from this step's K/V rows own_row, own_row + BLOCK_N, ..."""
    BLOCK_N: gl.constexpr = dest.shape[0]
    HEAD_DIM: gl.constexpr = dest.shape[1]
    PAGE: gl.constexpr = page_desc.block_type.shape[0]
    COLUMNS: gl.constexpr = page_desc.block_type.shape[1]
    mbarrier.expect(bar, desc.block_type.nbytes)
    if tile < num_prefix_tiles:
        for i in gl.static_range(BLOCK_N // PAGE):
            # Pages past the prefix's last repeat it (their rows are masked): the table's unused entries
            # need not be valid block ids.
            page = gl.load(block_table + gl.minimum(tile * (BLOCK_N // PAGE) + i, last_page))
            for c in gl.static_range(HEAD_DIM // COLUMNS):
                tma.async_copy_global_to_shared(page_desc, [page * PAGE, column + c * COLUMNS], bar,
                                                dest.slice(i * PAGE, PAGE, 0).slice(c * COLUMNS, COLUMNS, 1))
    else:
        tma.async_copy_global_to_shared(desc, [own_row + (tile - num_prefix_tiles) * BLOCK_N, column], bar, dest)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, kp_desc, vp_desc, q_smem, k_smem, v_smem, bars, plan_ptr,
              block_tables_ptr, block_table_stride, num_heads, num_queries_per_kv):
    # (Partition arguments arrive as values: shapes are read back from the buffers.)
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    PAGE: gl.constexpr = kp_desc.block_type.shape[0]
    q_full, q_empty, k_full, v_full, k_empty, v_empty = bars
    it = 0      # key tiles loaded so far: stage it % STAGES, round it // STAGES
    n = 0       # query tiles loaded so far
    num_tiles_total = gl.load(plan_ptr) * num_heads
    for t in range(gl.program_id(0), num_tiles_total, gl.num_programs(0)):
        seq, query_start, query_len, context_len, first_row = _tile(plan_ptr, t, num_heads)
        head = t % num_heads
        num_prefix_tiles = _cdiv(context_len, BLOCK_N)
        num_tiles = num_prefix_tiles + _cdiv(gl.minimum(first_row + BLOCK_M, query_len), BLOCK_N)
        last_page = gl.maximum(context_len - 1, 0) // PAGE
        block_table = block_tables_ptr + seq * block_table_stride
        kv_col = (head // num_queries_per_kv) * HEAD_DIM
        # Query slot n % 2 is free once both warpgroups issued their last QK^T of tile n - 2: the next
        # tile's queries load while this one runs.
        slot = n % 2
        mbarrier.wait(q_empty.index(slot), ((n // 2) & 1) ^ 1)
        mbarrier.expect(q_full.index(slot), 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [query_start + first_row, head * HEAD_DIM],
                                        q_full.index(slot), q_smem.index(2 * slot))
        tma.async_copy_global_to_shared(q_desc, [query_start + first_row + WG_ROWS, head * HEAD_DIM],
                                        q_full.index(slot), q_smem.index(2 * slot + 1))
        for j in range(num_tiles):
            stage = it % STAGES
            phase = (it // STAGES) & 1
            # A stage is free once both warpgroups released it (the first round passes at once).
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            _load_keys(k_desc, kp_desc, block_table, j, num_prefix_tiles, last_page, query_start, kv_col,
                       k_full.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            _load_keys(v_desc, vp_desc, block_table, j, num_prefix_tiles, last_page, query_start, kv_col,
                       v_full.index(stage), v_smem.index(stage))
            it += 1
        n += 1


@gluon.jit
def _masked_scores(s, tile, num_prefix_tiles, context_len, first_row, BLOCK_N: gl.constexpr,
                   s_layout: gl.constexpr):
    """Scores of keys a row must not see set to -inf: the prefix's last page's rows past the prefix,
    and this step's keys after the row's own position. Only the tiles that hold such keys pay for it."""
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if tile < num_prefix_tiles:
        if tile * BLOCK_N + BLOCK_N > context_len:
            rows = gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
            visible = gl.expand_dims(tile * BLOCK_N + keys, 0) < gl.expand_dims(rows * 0 + context_len, 1)
            s = gl.where(visible, s, float("-inf"))
    else:
        own = tile - num_prefix_tiles
        if own * BLOCK_N + BLOCK_N - 1 > first_row:
            rows = first_row + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
            visible = gl.expand_dims(own * BLOCK_N + keys, 0) <= gl.expand_dims(rows, 1)
            s = gl.where(visible, s, float("-inf"))
    return s


@gluon.jit
def _attend(q, k_smem, v_smem, k_full, v_full, k_empty, v_empty, it, first_row, my_tiles,
            num_prefix_tiles, context_len, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """One warpgroup's 64 rows over key tiles 0..my_tiles-1 (ring positions it, it + 1, ...):
    returns the unnormalised output and the softmax denominators."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=o_layout)

    # Tile 0 (it holds key 0, which every row sees): no product of values in flight yet.
    stage = it % STAGES
    mbarrier.wait(k_full.index(stage), (it // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(stage), count=1)
    s = _masked_scores(s, 0, num_prefix_tiles, context_len, first_row, BLOCK_N, s_layout)
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
        s = _masked_scores(s, j, num_prefix_tiles, context_len, first_row, BLOCK_N, s_layout)
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
def _consumer(wg, q_smem, k_smem, v_smem, o_smem, bars, o_desc, out_ptr, out_stride, plan_ptr, num_heads,
              qk_scale):
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    q_full, q_empty, k_full, v_full, k_empty, v_empty = bars
    o_buf = o_smem.index(wg)
    it = 0
    n = 0
    num_tiles_total = gl.load(plan_ptr) * num_heads
    for t in range(gl.program_id(0), num_tiles_total, gl.num_programs(0)):
        _, query_start, query_len, context_len, tile_row = _tile(plan_ptr, t, num_heads)
        head = t % num_heads
        slot = n % 2
        mbarrier.wait(q_full.index(slot), (n // 2) & 1)
        num_prefix_tiles = _cdiv(context_len, BLOCK_N)
        num_tiles = num_prefix_tiles + _cdiv(gl.minimum(tile_row + BLOCK_M, query_len), BLOCK_N)
        first_row = tile_row + wg * WG_ROWS
        # Tiles this warpgroup's rows need; one wholly past its sequence's end takes the prefix, or
        # one tile when there is none.
        my_tiles = num_prefix_tiles + _cdiv(gl.minimum(first_row + WG_ROWS, query_len), BLOCK_N)
        if first_row >= query_len:
            my_tiles = gl.maximum(num_prefix_tiles, 1)
        acc, l_i = _attend(q_smem.index(2 * slot + wg), k_smem, v_smem, k_full, v_full, k_empty, v_empty, it,
                           first_row, my_tiles, num_prefix_tiles, context_len, qk_scale, s_layout, o_layout)
        mbarrier.arrive(q_empty.index(slot), count=1)
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

        out = (acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)).to(o_desc.dtype)
        if first_row + WG_ROWS <= query_len:
            # A whole tile inside the sequence leaves through TMA, overlapping the next tile.
            tma.store_wait(0)
            o_buf.store(out)
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [query_start + first_row, head * HEAD_DIM], o_buf)
        else:   # (a warpgroup wholly past its sequence's end stores nothing)
            rows = first_row + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, o_layout))
            dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            offsets = (gl.expand_dims((query_start + rows).to(gl.int64) * out_stride, 1)
                       + gl.expand_dims(head * HEAD_DIM + dims, 0))
            gl.store(out_ptr + offsets, out, mask=gl.expand_dims(rows < query_len, 1))
    tma.store_wait(0)


# The block-table width changes from step to step: specialising on it (its divisibility by 16) would
# recompile the kernel in the middle of a run.
@gluon.jit(do_not_specialize=["block_table_stride"])
def _prefill_kernel(q_desc, k_desc, v_desc, kp_desc, vp_desc, o_desc, out_ptr, plan_ptr, block_tables_ptr,
                    block_table_stride, qk_scale, num_heads,
                    num_queries_per_kv, out_stride, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    # Two query slots (a tile's rows for each warpgroup), so the next tile's queries load during this one.
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [4, WG_ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [2, WG_ROWS, HEAD_DIM], o_desc.layout)
    q_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()

    bars = (q_full, q_empty, k_full, v_full, k_empty, v_empty)
    consumer_args = (q_smem, k_smem, v_smem, o_smem, bars, o_desc, out_ptr, out_stride, plan_ptr, num_heads,
                     qk_scale)
    gl.warp_specialize([
        (_consumer, (0,) + consumer_args),
        (_consumer, (1,) + consumer_args),
        (_producer, (q_desc, k_desc, v_desc, kp_desc, vp_desc, q_smem, k_smem, v_smem, bars, plan_ptr,
                     block_tables_ptr, block_table_stride, num_heads, num_queries_per_kv)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@triton.jit(do_not_specialize=["num_seqs", "bound"])
def _plan_kernel(query_start_loc_ptr, seq_lens_ptr, plan_ptr, num_seqs, bound, MIN_QUERY_LEN: tl.constexpr,
                 BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, ROW: tl.constexpr):
    # One program. Pass 1 writes each tile's fields and key (keys read) to scratch rows after the plan's;
    # pass 2 gives each its rank (more keys first, ties by tile number) and copies it into place.
    s = tl.arange(0, BLOCK_S)
    in_batch = s < num_seqs
    starts = tl.load(query_start_loc_ptr + s, mask=in_batch, other=0)
    lens = tl.load(query_start_loc_ptr + s + 1, mask=in_batch, other=0) - starts
    contexts = tl.load(seq_lens_ptr + s, mask=in_batch, other=0) - lens
    long = in_batch & (lens >= MIN_QUERY_LEN)
    tiles = tl.where(long, (lens + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(tiles, 0)
    count = tl.sum(tiles, 0)
    num_short = tl.sum((in_batch & (lens > 0) & ~long).to(tl.int32), 0)
    fields = tl.arange(0, ROW)
    tl.store(plan_ptr + fields, tl.where(fields == 0, count, tl.where(fields == 1, num_short, 0)))
    scratch = plan_ptr + (1 + bound) * ROW
    for r0 in range(0, bound, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        seq = tl.sum(((ends[None, :] <= r[:, None]) & in_batch[None, :]).to(tl.int32), 1)
        seq = tl.minimum(seq, num_seqs - 1)
        owner = s[None, :] == seq[:, None]
        first_row = (r - tl.sum(tl.where(owner, ends - tiles, 0), 1)) * BLOCK_M
        length = tl.sum(tl.where(owner, lens, 0), 1)
        context = tl.sum(tl.where(owner, contexts, 0), 1)
        key = tl.where(r < count, context + tl.minimum(first_row + BLOCK_M, length), -1)
        row = scratch + r * ROW
        in_plan = r < bound
        tl.store(row, seq, mask=in_plan)
        tl.store(row + 1, tl.sum(tl.where(owner, starts, 0), 1), mask=in_plan)
        tl.store(row + 2, length, mask=in_plan)
        tl.store(row + 3, context, mask=in_plan)
        tl.store(row + 4, first_row, mask=in_plan)
        tl.store(row + 5, key, mask=in_plan)
    tl.debug_barrier()
    for r0 in range(0, bound, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        in_plan = r < bound
        key = tl.load(scratch + r * ROW + 5, mask=in_plan, other=-2)
        rank = tl.zeros([CHUNK], tl.int32)
        for j0 in range(0, bound, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            other = tl.load(scratch + j * ROW + 5, mask=j < bound, other=-2)
            ahead = (other[None, :] > key[:, None]) | ((other[None, :] == key[:, None]) & (j[None, :] < r[:, None]))
            rank += tl.sum((ahead & (j < bound)[None, :]).to(tl.int32), 1)
        source = scratch + r[:, None] * ROW + fields[None, :]
        values = tl.load(source, mask=in_plan[:, None] & (fields < 5)[None, :], other=0)
        tl.store(plan_ptr + (1 + rank[:, None]) * ROW + fields[None, :], values, mask=in_plan[:, None])


def plan_bound(num_tokens: int, num_seqs: int, min_query_len: int = MIN_QUERY_LEN) -> int:
    """Most 128-row tiles sequences of >= min_query_len rows can have among num_tokens rows."""
    return max(1, num_tokens // BLOCK_M.value + min(num_seqs, num_tokens // min_query_len))


def plan_query_tiles(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
                     min_query_len: int = MIN_QUERY_LEN) -> torch.Tensor:
    """The step's query tiles for the kernel, computed on the device by one small kernel (no host sync,
    so it is captured in CUDA graphs): int32 [1 + bound, PLAN_ROW] (plus scratch rows after them). Row 0
    holds the number of tiles and the number of sequences with 1 to min_query_len - 1 query rows (the
    Triton kernel's); then one row per 128-row tile of each sequence with at least `min_query_len` query
    rows, (sequence, its first query token, query length, cached prefix length, the tile's first row),
    sorted by the keys the tile reads, most first; rows after the count are filler. Built once per step,
    shared by every layer. Reference: `plan_query_tiles_reference`."""
    num_seqs = seq_lens.shape[0]
    bound = plan_bound(num_tokens, num_seqs, min_query_len)
    plan = torch.empty(1 + 2 * bound, PLAN_ROW.value, dtype=torch.int32, device=seq_lens.device)
    block_s = max(256, triton.next_power_of_2(num_seqs))   # one compiled variant up to 256 sequences
    _plan_kernel[(1,)](query_start_loc, seq_lens, plan, num_seqs, bound, MIN_QUERY_LEN=min_query_len,
                       BLOCK_S=block_s, CHUNK=16 if block_s <= 256 else 4, BLOCK_M=BLOCK_M.value,
                       ROW=PLAN_ROW.value, num_warps=4)
    return plan[:1 + bound]


def plan_query_tiles_reference(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
                               min_query_len: int = MIN_QUERY_LEN) -> torch.Tensor:
    """`plan_query_tiles` in torch ops (ties in the keys ordered by tile number, as the kernel does)."""
    num_seqs = seq_lens.shape[0]
    block_m = BLOCK_M.value
    bound = plan_bound(num_tokens, num_seqs, min_query_len)
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    contexts = seq_lens.long() - lens
    long = lens >= min_query_len
    tiles = torch.where(long, (lens + block_m - 1) // block_m, 0)
    ends = tiles.cumsum(0)
    index = torch.arange(bound, device=lens.device)
    seq = torch.searchsorted(ends, index, right=True).clamp_(max=max(num_seqs - 1, 0))
    first_row = (index - (ends - tiles)[seq]) * block_m
    keys = torch.where(index < ends[-1], contexts[seq] + torch.minimum(first_row + block_m, lens[seq]), -1)
    order = torch.sort(keys, descending=True, stable=True).indices
    rows = torch.stack([seq, starts[seq], lens[seq], contexts[seq], first_row], dim=1)[order]
    header = torch.stack([ends[-1], ((lens > 0) & ~long).sum()]).view(1, 2)
    header = torch.nn.functional.pad(header, (0, rows.shape[1] - 2))
    return torch.nn.functional.pad(torch.cat([header, rows]), (0, PLAN_ROW.value - rows.shape[1])).to(torch.int32)


def supported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> bool:
    """Hopper, 16-bit everywhere (no fp8 cache), head_dim 64 or 128, pages of a multiple of 8 tokens
    dividing 128, heads packed, rows 16-byte aligned and the caches contiguous (TMA)."""
    if not (query.is_cuda and _capability(query.device) == (9, 0)):
        return False
    head_dim = query.shape[-1]
    block_size = k_cache.shape[1]
    return (query.dtype in (torch.bfloat16, torch.float16) and head_dim in (64, 128)
            and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype == query.dtype
            and block_size % 8 == 0 and 128 % block_size == 0
            and all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (k_cache, v_cache))
            and all(x.stride(2) == 1 and x.stride(1) == head_dim and x.stride(0) * 2 % 16 == 0
                    and x.data_ptr() % 16 == 0 for x in (query, key, value)))


@functools.lru_cache(maxsize=None)
def _layout(rows: int, columns: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([rows, columns], gl.bfloat16 if dtype == torch.bfloat16
                                                else gl.float16)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_tables: torch.Tensor, plan: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None, block_n: int = 128, stages: int = 2,
                      programs: int | None = None) -> torch.Tensor:
    """query [tokens, heads, D], this step's key/value [tokens, kv_heads, D] (already in the caches
    [blocks, block_size, kv_heads, D] too) -> `out` [tokens, heads, D] with the rows of the sequences
    `plan` lists written (`plan_query_tiles` of the step's query_start_loc and seq_lens; the other rows
    are left as they were)."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out

    def descriptor(x, rows, columns, box_rows, box_columns):
        return TensorDescriptor(x, [rows, columns], [x.stride(0), 1], [box_rows, box_columns],
                                _layout(box_rows, box_columns, x.dtype))

    width = num_kv_heads * head_dim
    pages = [descriptor(c.view(num_blocks * block_size, width), num_blocks * block_size, width, block_size,
                        PAGE_COLUMNS) for c in (k_cache, v_cache)]
    programs = min(programs or num_sms(query.device), (plan.shape[0] - 1) * num_heads)
    _prefill_kernel[(programs,)](
        descriptor(query, num_tokens, num_heads * head_dim, WG_ROWS.value, head_dim),
        descriptor(key, num_tokens, width, block_n, head_dim), descriptor(value, num_tokens, width, block_n, head_dim),
        *pages, descriptor(out, num_tokens, num_heads * head_dim, WG_ROWS.value, head_dim), out, plan,
        block_tables, block_tables.stride(0), scale * LOG2_E, num_heads,
        num_heads // num_kv_heads, out.stride(0), BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=stages,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return out
