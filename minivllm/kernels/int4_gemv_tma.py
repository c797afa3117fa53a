"""The batch-1 int4 GEMV on Hopper (sm_90), in Gluon: weights streamed by TMA, the first ones before the PDL wait.

Why a second GEMV beside the Triton ones (`int4_gemm._int4_gemv_kernel`, `int4_gemv_half.py`): those load their
words with per-thread copies a few K steps ahead and split K to fill the GPU, so the first bytes arrive one DRAM
latency after the PDL wait, the split-K partials are summed after the last slice, and the loads in flight per SM
are few; each costs about 6 us more than its bytes in a decode step (o_proj: 10.4 us for 8.4 MB on the H100).
Here persistent programs (one or two an SM) own whole column tiles (all of K, no split-K and no partials) and
stream their packed words, scales and zeros through a ring of STAGES shared-memory stages, each filled by three
TMA copies (two for symmetric weights, below) and guarded by an mbarrier. The ring is filled before
`griddepcontrol.wait`: the weights depend on no earlier kernel, so under PDL they cross HBM while the previous
kernel (a norm, the attention reduce, SiLU) still runs, and only x is read after the wait, one step ahead of the
arithmetic that uses it. All warps consume every stage; a CTA barrier after a stage's words reach registers frees
it for the copy STAGES steps ahead. Timed cold at M = 1 on the H100, o_proj takes 5.4 us and qkv_proj 7.6 us
against 8.6 and 10.4 for the best Triton GEMV (WRITEUP.md, section 8).

Arithmetic is the fp32 GEMV's (`int4_gemm._nibble_pair`: a code read as a float through a mantissa, a shift per
two codes, one LOP3 and one FMA per weight) or the packed-half GEMV's (`int4_gemv_half.WORD_ASM`, two weights an
instruction). A thread holds `rows` word rows of a group for `columns` columns and sums them in registers; the
group's zero point and scale then apply once per column, and the thread keeps that partial over all of K. The
tile's partials are reduced across threads once, at its end.

Epilogues: the descriptors view the weights as [rows, heads, halves, columns], so a tile can hold paired columns
and finish them itself: gate_up's gate and up columns (silu(gate) * up, in place of the activation kernel) and
qkv_proj's rotary pairs d, d + head_dim / 2 of a head (in place of the rotary kernel); layers/fusion.py picks both
at one row. The stream is the limit: without the arithmetic the GEMVs take as long, and deeper rings are slower.

Norms: with `norm` (a RowNorm) x is a decoder layer's un-normed input, and each program stages
RMSNorm(x [+ residual]) * weight in shared memory before its loop, rounded as kernels/rmsnorm.py rounds; program
0 writes x + residual, the residual stream's next value. The norm's weights are read before the PDL wait; the
whole row is read by every program (a tile owns all of K), 8-16 KB from L2. qkv_proj and gate_up_proj take their
layer's norms this way at one row (layers/fusion.norms_in_gemvs), so a layer runs no norm kernel. The residual is
added here rather than in o_proj's and down_proj's epilogues, which ran those two 1.5 and 5.0 us slower.

KV write: with a `KVWrite`, the rotary tile of a k or v head also stores it in the paged KV cache at the token's
slot (kernels/kv_write.py's layout), and the attention layer runs no KV write kernel (int4 batch 1 on the H100:
381.6 tok/s against 375.7 with the separate kernel).

Symmetric weights and the SM to itself: where every zero point is 8 (GPTQ `sym`, compressed-tensors), the kernel
takes it as a constant and streams codes and scales only (1/34 fewer bytes at group 128). With fewer registers a
program would leave room on its SM, and the next GEMV's programs, launched early under PDL, would move in and
start their copies while this one still streams; so each program holds enough shared memory (`reserved_bytes`)
that an SM full of one GEMV's programs has no room for another's. int4 batch 1 on the H100: 409.2 tok/s, against
391.9 reading the zeros and 375.2 with constant zeros but no reservation.

Layout (quantization/packing.py): qweight [K / 8, N] int32 packed along K, scales and zeros [K / group, N].
No interpreter exists for Gluon: CI compiles the kernel for sm_90 and the `gpu` tests compare it with
`int4_gemm.weight_only_gemm_reference`.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from minivllm.kernels.int4_gemv_half import (ADD_HALVES_ASM, HALVES_SUM_ASM, PAIRS_BF16, PAIRS_FP16, SPLAT_HALF_ASM,
                                             WORD_ASM)
from minivllm.kernels.pdl import gluon_wait_for_previous
from minivllm.kernels.pdl import mode as pdl_mode
from minivllm.kernels.rmsnorm import RowNorm
from minivllm.kernels.split_k import num_sms


class TmaGemvConfig(NamedTuple):
    """block_n columns a tile; groups: quantization groups a stage; columns: adjacent columns a thread holds (one
    shared-memory load of 4 x columns bytes a word row); rows: word rows of a group a thread holds, summed in
    registers before the group's scale; per_sm: programs an SM (more warps to hide latency, each ring smaller);
    half: the packed-half arithmetic of kernels/int4_gemv_half.py (two weights an instruction)."""
    block_n: int
    groups: int
    stages: int
    num_warps: int
    columns: int = 4
    rows: int = 4
    per_sm: int = 1
    half: bool = False


# H100 candidates: the best tiles per 8B layer (qkv, o, gate_up, down) of bench/kernels/gemv_cold_sweep.py
# --tma-sweep, fp32 and packed half, and two that divide groups of 32 and 64
TMA_GEMV_TILES = (TmaGemvConfig(32, 16, 2, 4, columns=8, rows=2, per_sm=2, half=True),
                  TmaGemvConfig(64, 8, 2, 4, columns=8, rows=2, per_sm=2, half=True),
                  TmaGemvConfig(32, 16, 3, 8, rows=2, half=True), TmaGemvConfig(16, 8, 3, 4, rows=2, per_sm=2),
                  TmaGemvConfig(64, 8, 2, 4, columns=8, per_sm=2), TmaGemvConfig(16, 16, 3, 4, rows=2, per_sm=2),
                  TmaGemvConfig(32, 16, 2, 4, columns=8, per_sm=2), TmaGemvConfig(32, 16, 2, 4, rows=1),
                  TmaGemvConfig(16, 8, 4, 4, rows=2))


def layout_split(config: TmaGemvConfig, group_rows: int) -> tuple[int, int, int, int, int] | None:
    """Threads along groups, row chunks and columns, warps along groups and columns, of the register tile
    [groups, group_rows / rows, rows, block_n]; None where the config does not divide it."""
    if config.block_n % config.columns or group_rows % config.rows:
        return None
    threads_n = min(32, config.block_n // config.columns)
    threads_r = min(32 // threads_n, group_rows // config.rows)
    threads_g = 32 // threads_n // threads_r
    warps_n = config.block_n // (config.columns * threads_n)
    if config.num_warps % warps_n:
        return None
    warps_g = config.num_warps // warps_n
    if config.groups % (threads_g * warps_g):
        return None
    return threads_g, threads_r, threads_n, warps_g, warps_n


# Gluon's sum and cdiv wrap triton.jit functions, which become interpreter objects under TRITON_INTERPRET=1 (set
# for the CPU tests, which compile this kernel for sm_90); these do not.
@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _cdiv(a, b):
    return (a + b - 1) // b


@gluon.jit
def _tile_origin(tile, tiles_per_row, WIDTH: gl.constexpr):
    """(head, first column) of a tile: the weights are viewed as [rows, heads, halves, columns]."""
    return tile // tiles_per_row, (tile % tiles_per_row) * WIDTH


@gluon.jit
def _issue(step, codes_desc, scales_desc, zeros_desc, codes, scales, zeros, full, first_tile, num_programs,
           k_steps, tiles_per_row, STAGES: gl.constexpr, READ_ZEROS: gl.constexpr):
    """TMA copies of step `step` (this program's tiles in order, K fastest) into stage step % STAGES; the
    zeros' only where READ_ZEROS. The descriptors view the weights as [rows, heads, halves, columns]: a tile is
    the same WIDTH columns of each half of one head, so paired columns (gate and up; a head's rotary pairs d and
    d + D / 2) share a tile."""
    ROWS: gl.constexpr = codes_desc.block_type.shape[0]
    GROUPS: gl.constexpr = scales_desc.block_type.shape[0]
    WIDTH: gl.constexpr = codes_desc.block_type.shape[3]
    stage = step % STAGES
    head, n0 = _tile_origin(first_tile + (step // k_steps) * num_programs, tiles_per_row, WIDTH)
    k_step = step % k_steps
    bar = full.index(stage)
    nbytes: gl.constexpr = codes_desc.block_type.nbytes + scales_desc.block_type.nbytes
    if READ_ZEROS:
        mbarrier.expect(bar, nbytes + zeros_desc.block_type.nbytes)
    else:
        mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(codes_desc, [k_step * ROWS, head, 0, n0], bar, codes.index(stage))
    tma.async_copy_global_to_shared(scales_desc, [k_step * GROUPS, head, 0, n0], bar, scales.index(stage))
    if READ_ZEROS:
        tma.async_copy_global_to_shared(zeros_desc, [k_step * GROUPS, head, 0, n0], bar, zeros.index(stage))


@gluon.jit
def _field_pair(words, SHIFT: gl.constexpr):
    """Word fields 2j and 2j + 1 (SHIFT = 15 - 8j moves them to bits 15-18 and 19-22) as the floats
    16 + code / 16 and 1 + code / 16: exact (`int4_gemm._nibble_pair`)."""
    if SHIFT > 0:
        moved = words << SHIFT
    else:
        moved = words >> -SHIFT   # arithmetic: the bits it drags in are masked off
    low = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00078000, 0x41800000, 0xEA;", "=r,r", [moved],
                                    dtype=gl.float32, is_pure=True, pack=1)
    high = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00780000, 0x3F800000, 0xEA;", "=r,r", [moved],
                                     dtype=gl.float32, is_pure=True, pack=1)
    return low, high


@gluon.jit
def _x_words(x_ptr, word_rows, K, EVEN_K: gl.constexpr):
    """x at the 8 positions of `word_rows` as four 32-bit words, each a pair of 16-bit values (k, k + 1) for
    k = 8 r, 8 r + 2, 8 r + 4, 8 r + 6; x beyond K reads as zero (K is even: the group size is)."""
    x_words = x_ptr.to(gl.pointer_type(gl.int32)) + word_rows * 4
    if EVEN_K:
        return gl.load(x_words), gl.load(x_words + 1), gl.load(x_words + 2), gl.load(x_words + 3)
    k = word_rows * 8
    return (gl.load(x_words, mask=k < K, other=0), gl.load(x_words + 1, mask=k + 2 < K, other=0),
            gl.load(x_words + 2, mask=k + 4 < K, other=0), gl.load(x_words + 3, mask=k + 6 < K, other=0))


@gluon.jit
def _pair_floats(word, IS_BF16: gl.constexpr):
    """A word of two 16-bit x values as two fp32 (a bf16 is the top half of its fp32)."""
    if IS_BF16:
        return (word << 16).to(gl.float32, bitcast=True), (word & -65536).to(gl.float32, bitcast=True)
    low = (word & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    high = (word >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    return low, high


@gluon.jit
def _add_halves(a, b):
    return gl.inline_asm_elementwise(ADD_HALVES_ASM, "=r,r,r", [a, b], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _halves_sum(v):
    return gl.inline_asm_elementwise(HALVES_SUM_ASM, "=r,r", [v], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _splat_half(v):
    return gl.inline_asm_elementwise(SPLAT_HALF_ASM, "=r,r", [v], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _half_step(words, xa, xb, xc, xd, scale, zero, IS_BF16: gl.constexpr, FRACTIONAL_ZEROS: gl.constexpr):
    """A stage's contribution [groups, chunks, columns] in packed-half arithmetic (kernels/int4_gemv_half.py): a
    word's 8 weights in 13 instructions, x as f16x2 pairs (x[k], x[k + 4]), a chunk's rows summed in f16x2."""
    if IS_BF16:
        p0, p1 = gl.inline_asm_elementwise(PAIRS_BF16, "=r,=r,r,r", [xa, xc], dtype=(gl.int32, gl.int32),
                                           is_pure=True, pack=1)
        p2, p3 = gl.inline_asm_elementwise(PAIRS_BF16, "=r,=r,r,r", [xb, xd], dtype=(gl.int32, gl.int32),
                                           is_pure=True, pack=1)
    else:
        p0, p1 = gl.inline_asm_elementwise(PAIRS_FP16, "=r,=r,r,r", [xa, xc], dtype=(gl.int32, gl.int32),
                                           is_pure=True, pack=1)
        p2, p3 = gl.inline_asm_elementwise(PAIRS_FP16, "=r,=r,r,r", [xb, xd], dtype=(gl.int32, gl.int32),
                                           is_pure=True, pack=1)
    exact_low, exact_high = 4.0 + zero * 0.00390625, 0.25 + zero * 0.00390625   # z / 256
    low_centre, neg_high_centre = _splat_half(exact_low), _splat_half(-exact_high)
    acc = gl.inline_asm_elementwise(
        WORD_ASM, "=r,r,r,r,r,r,r,r,r",
        [words, p0[:, :, :, None], p1[:, :, :, None], p2[:, :, :, None], p3[:, :, :, None],
         low_centre[:, None, None, :], neg_high_centre[:, None, None, :], gl.zeros_like(words)],
        dtype=gl.int32, is_pure=True, pack=1)
    column = _halves_sum(gl.reduce(acc, 2, _add_halves))
    if FRACTIONAL_ZEROS:   # the centres' rounding to fp16 (none for integer zero points below 1024)
        low_x = gl.reduce((_halves_sum(p0) + _halves_sum(p2))[:, :, :, None], 2, _add)
        high_x = gl.reduce((_halves_sum(p1) + _halves_sum(p3))[:, :, :, None], 2, _add)
        column -= (exact_low - _halves_sum(low_centre) * 0.5)[:, None, :] * low_x
        column -= (exact_high + _halves_sum(neg_high_centre) * 0.5)[:, None, :] * high_x
    return (256.0 * scale)[:, None, :] * column


@gluon.jit
def _fp32_word(sums, even, odd, words, xw, SHIFT: gl.constexpr, IS_BF16: gl.constexpr):
    x_low, x_high = _pair_floats(xw, IS_BF16)
    f_low, f_high = _field_pair(words, SHIFT)
    return sums + x_low[:, :, :, None] * f_low + x_high[:, :, :, None] * f_high, even + x_low, odd + x_high


@gluon.jit
def _fp32_step(words, xa, xb, xc, xd, scale, zero, IS_BF16: gl.constexpr):
    """A stage's contribution [groups, chunks, columns] with fp32 products (`int4_gemm._nibble_pair`)."""
    x_low, x_high = _pair_floats(xa, IS_BF16)
    f_low, f_high = _field_pair(words, 15)
    sums = x_low[:, :, :, None] * f_low + x_high[:, :, :, None] * f_high
    even = x_low
    odd = x_high
    sums, even, odd = _fp32_word(sums, even, odd, words, xb, 7, IS_BF16)
    sums, even, odd = _fp32_word(sums, even, odd, words, xc, -1, IS_BF16)
    sums, even, odd = _fp32_word(sums, even, odd, words, xd, -9, IS_BF16)
    # each product is x q / 16 plus 16 x (even fields) or x (odd ones): a chunk's sum minus those is
    # sum x q / 16, and y += 16 s (that) - s z (sum x); the rows' sums stay in the thread
    column = gl.reduce(sums, 2, _add) - gl.reduce((16.0 * even + odd)[:, :, :, None], 2, _add)
    x_sum = gl.reduce((even + odd)[:, :, :, None], 2, _add)
    return (16.0 * scale)[:, None, :] * column - (scale * zero)[:, None, :] * x_sum


EPILOGUE_STORE, EPILOGUE_SILU_AND_MUL, EPILOGUE_ROTARY = 0, 1, 2


@gluon.jit
def _store_tile(y_ptr, acc, y_buffer, head, n0, N, positions_ptr, cos_sin_ptr, cos_sin_stride, rotated_heads,
                kv, out_layout: gl.constexpr, EPILOGUE: gl.constexpr, BLOCK_N: gl.constexpr,
                NUM_WARPS: gl.constexpr, WRITE_KV: gl.constexpr, KV_BLOCK: gl.constexpr):
    """A finished tile to y: its columns' sums (EPILOGUE_STORE); silu(first half) * second half, y being N
    columns wide (EPILOGUE_SILU_AND_MUL); or, for heads of 2 N columns, the halves rotated as kernels/rotary.py
    does at the token's position, heads from `rotated_heads` on (v) stored as they are (EPILOGUE_ROTARY). WRITE_KV
    (rotary only): a k or v head is also stored into its paged cache at the token's slot (`_kv_row`)."""
    y = gl.reduce(gl.reduce(acc, 1, _add), 0, _add)
    if EPILOGUE == 0:
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=out_layout)
        gl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)
    else:
        WIDTH: gl.constexpr = BLOCK_N // 2
        half_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        gl.thread_barrier()   # the last tile's halves are read
        y_buffer.store(y)
        gl.thread_barrier()
        first = y_buffer.slice(0, WIDTH).load(half_layout)
        second = y_buffer.slice(WIDTH, WIDTH).load(half_layout)
        offs_n = n0 + gl.arange(0, WIDTH, layout=half_layout)
        if EPILOGUE == 1:
            out = first / (1.0 + gl.exp(-first)) * second
            gl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=offs_n < N)
        else:
            row = cos_sin_ptr + gl.load(positions_ptr).to(gl.int64) * cos_sin_stride
            rotate = head < rotated_heads
            cos = gl.where(rotate, gl.load(row + offs_n), 1.0)
            sin = gl.where(rotate, gl.load(row + N + offs_n), 0.0)
            out = y_ptr + head * (2 * N) + offs_n
            low = (first * cos - second * sin).to(y_ptr.dtype.element_ty)
            high = (second * cos + first * sin).to(y_ptr.dtype.element_ty)
            gl.store(out, low)
            gl.store(out + N, high)
            if WRITE_KV:
                k_cache_ptr, v_cache_ptr, slot_ptr, stride_block, stride_row, stride_head, q_heads, kv_heads = kv
                if head >= q_heads:   # a k head (rotated) or a v head: its row of the token's cache slot
                    slot = gl.load(slot_ptr)
                    if slot >= 0:
                        slot_row = (slot // KV_BLOCK) * stride_block + (slot % KV_BLOCK) * stride_row
                        if head >= q_heads + kv_heads:
                            cache = v_cache_ptr + slot_row + (head - q_heads - kv_heads) * stride_head
                        else:
                            cache = k_cache_ptr + slot_row + (head - q_heads) * stride_head
                        gl.store(cache + offs_n, low)
                        gl.store(cache + N + offs_n, high)


@gluon.jit
def _norm_weight_words(weight_ptr, K, X_STEPS: gl.constexpr, RPS: gl.constexpr, layout: gl.constexpr):
    """The norm's weights as the [X_STEPS * 4, RPS] words `_stage_normed_x` scales x by (row 4 s + j: word j
    of each word row of K step s), 0 past K."""
    offs_i = gl.arange(0, X_STEPS * 4, layout=gl.SliceLayout(1, layout))
    offs_r = gl.arange(0, RPS, layout=gl.SliceLayout(0, layout))
    words = ((offs_i[:, None] // 4) * RPS + offs_r[None, :]) * 4 + offs_i[:, None] % 4
    return words, gl.load(weight_ptr.to(gl.pointer_type(gl.int32)) + words, mask=words * 2 < K, other=0)


@gluon.jit
def _rounded_pair(low, high, dtype: gl.constexpr):
    """Two fp32 rounded to `dtype` and packed into one word (low in bits 0-15)."""
    low16 = low.to(dtype).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    high16 = high.to(dtype).to(gl.int16, bitcast=True).to(gl.int32)
    return (high16 << 16) | low16


@gluon.jit
def _stage_normed_x(x_ptr, residual_ptr, stream_ptr, words, weight_words, x_smem, K, eps, IS_BF16: gl.constexpr,
                    ADD: gl.constexpr):
    """RMSNorm(x) * weight into x_smem as [K step, word j, word row], rounded as kernels/rmsnorm.py rounds
    (normalised in fp32, rounded, scaled, rounded); ADD: of x + residual, rounded, which program 0 also writes
    to the stream's next value. Every program reads the whole row for its sum of squares: the tile owns all of
    K, so the row's norm costs a 2K-byte read (4K with the residual) from L2 and no other kernel."""
    dtype: gl.constexpr = gl.bfloat16 if IS_BF16 else gl.float16
    inside = words * 2 < K
    x = gl.load(x_ptr.to(gl.pointer_type(gl.int32)) + words, mask=inside, other=0)
    if ADD:
        residual = gl.load(residual_ptr.to(gl.pointer_type(gl.int32)) + words, mask=inside, other=0)
        x_low, x_high = _pair_floats(x, IS_BF16)
        r_low, r_high = _pair_floats(residual, IS_BF16)
        x = _rounded_pair(x_low + r_low, x_high + r_high, dtype)
        gl.store(stream_ptr.to(gl.pointer_type(gl.int32)) + words, x, mask=inside & (gl.program_id(0) == 0))
    low, high = _pair_floats(x, IS_BF16)
    squares = gl.reduce(gl.reduce(low * low + high * high, 1, _add), 0, _add)
    inv_rms = gl.rsqrt(squares / K + eps)
    w_low, w_high = _pair_floats(weight_words, IS_BF16)
    normed_low = (low * inv_rms).to(dtype).to(gl.float32)
    normed_high = (high * inv_rms).to(dtype).to(gl.float32)
    x_smem.store(_rounded_pair(normed_low * w_low, normed_high * w_high, dtype))


@gluon.jit
def _smem_x_words(x_smem, k_step, GROUPS: gl.constexpr, CHUNKS: gl.constexpr, ROWS: gl.constexpr,
                  row_layout: gl.constexpr):
    """A K step's four x words from the staged, normed row, as `_x_words` returns them."""
    return (x_smem.index(4 * k_step).reshape([GROUPS, CHUNKS, ROWS]).load(row_layout),
            x_smem.index(4 * k_step + 1).reshape([GROUPS, CHUNKS, ROWS]).load(row_layout),
            x_smem.index(4 * k_step + 2).reshape([GROUPS, CHUNKS, ROWS]).load(row_layout),
            x_smem.index(4 * k_step + 3).reshape([GROUPS, CHUNKS, ROWS]).load(row_layout))


@gluon.jit
def _int4_gemv_tma_kernel(x_ptr, codes_desc, scales_desc, zeros_desc, y_ptr, N, K, num_tiles, tiles_per_row,
                          positions_ptr, cos_sin_ptr, cos_sin_stride, rotated_heads, norm_weight_ptr, eps,
                          residual_ptr, stream_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, cache_stride_block,
                          cache_stride_row, cache_stride_head, q_heads, kv_heads, STAGES: gl.constexpr, GROUP_ROWS: gl.constexpr,
                          COLUMNS: gl.constexpr, ROWS: gl.constexpr, THREADS_G: gl.constexpr, THREADS_R: gl.constexpr,
                          THREADS_N: gl.constexpr, WARPS_G: gl.constexpr, WARPS_N: gl.constexpr,
                          IS_BF16: gl.constexpr, EVEN_K: gl.constexpr, HALF: gl.constexpr,
                          FRACTIONAL_ZEROS: gl.constexpr, EPILOGUE: gl.constexpr, NORM: gl.constexpr,
                          ADD_RESIDUAL: gl.constexpr, X_STEPS: gl.constexpr, WRITE_KV: gl.constexpr,
                          KV_BLOCK: gl.constexpr, SHARED_ZERO: gl.constexpr, RESERVE: gl.constexpr,
                          PDL: gl.constexpr):
    GROUPS: gl.constexpr = scales_desc.block_type.shape[0]
    HALVES: gl.constexpr = codes_desc.block_type.shape[2]
    WIDTH: gl.constexpr = codes_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = HALVES * WIDTH
    CHUNKS: gl.constexpr = GROUP_ROWS // ROWS
    # [groups, row chunks, rows, columns]: a thread's ROWS word rows of a group are summed in registers
    layout: gl.constexpr = gl.BlockedLayout([1, 1, ROWS, COLUMNS], [THREADS_G, THREADS_R, 1, THREADS_N],
                                            [WARPS_G, 1, 1, WARPS_N], [3, 2, 1, 0])
    chunk_layout: gl.constexpr = gl.SliceLayout(2, layout)               # [groups, chunks, columns]
    group_layout: gl.constexpr = gl.SliceLayout(1, chunk_layout)         # [groups, columns]: scales, zeros
    row_layout: gl.constexpr = gl.SliceLayout(3, layout)                 # [groups, chunks, rows]: x
    out_layout: gl.constexpr = gl.SliceLayout(0, group_layout)

    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    k_steps = _cdiv(K, GROUPS * GROUP_ROWS * 8)
    total = _cdiv(num_tiles - pid, num_programs) * k_steps

    codes = gl.allocate_shared_memory(gl.int32, [STAGES, GROUPS * GROUP_ROWS, 1, HALVES, WIDTH], codes_desc.layout)
    scales = gl.allocate_shared_memory(scales_desc.dtype, [STAGES, GROUPS, 1, HALVES, WIDTH], scales_desc.layout)
    READ_ZEROS: gl.constexpr = SHARED_ZERO is None
    if READ_ZEROS:
        zeros = gl.allocate_shared_memory(zeros_desc.dtype, [STAGES, GROUPS, 1, HALVES, WIDTH], zeros_desc.layout)
    else:   # symmetric weights: every group's zero point is SHARED_ZERO, and their bytes stay in HBM
        zeros = scales
    y_buffer = gl.allocate_shared_memory(gl.float32, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if RESERVE > 0:   # shared memory held only to keep other GEMVs' programs off this SM (`reserved_bytes`)
        reserve = gl.allocate_shared_memory(gl.int32, [RESERVE // 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
    fence_async_shared()
    gl.thread_barrier()
    for s in gl.static_range(STAGES):   # weights only: before the wait, while the previous kernel runs
        if s < total:
            _issue(s, codes_desc, scales_desc, zeros_desc, codes, scales, zeros, full, pid, num_programs, k_steps,
                   tiles_per_row, STAGES, READ_ZEROS)
    if NORM:   # RMSNorm(x [+ residual]) * weight, staged once (the norm's weights read before the wait)
        RPS: gl.constexpr = GROUPS * GROUP_ROWS
        NUM_WARPS: gl.constexpr = WARPS_G * WARPS_N
        stage_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NUM_WARPS], [1, 0])
        x_smem = gl.allocate_shared_memory(gl.int32, [X_STEPS * 4, RPS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        row_words, weight_words = _norm_weight_words(norm_weight_ptr, K, X_STEPS, RPS, stage_layout)
    gluon_wait_for_previous(PDL)
    if NORM:
        # stored through a rank-2 view: the buffer's rank-1 layout is what lets a K step's word j be indexed
        stage_view = x_smem._reinterpret(gl.int32, [X_STEPS * 4, RPS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        _stage_normed_x(x_ptr, residual_ptr, stream_ptr, row_words, weight_words, stage_view, K, eps, IS_BF16,
                        ADD_RESIDUAL)
        gl.thread_barrier()

    offs_g = gl.arange(0, GROUPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, row_layout)))
    offs_c = gl.arange(0, CHUNKS, layout=gl.SliceLayout(0, gl.SliceLayout(2, row_layout)))
    offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, row_layout)))
    tile_rows = offs_g[:, None, None] * GROUP_ROWS + offs_c[None, :, None] * ROWS + offs_r[None, None, :]
    acc = gl.zeros([GROUPS, CHUNKS, BLOCK_N], gl.float32, chunk_layout)
    if NORM:
        xa, xb, xc, xd = _smem_x_words(x_smem, 0, GROUPS, CHUNKS, ROWS, row_layout)
    else:
        xa, xb, xc, xd = _x_words(x_ptr, tile_rows, K, EVEN_K)
    for step in range(total):
        stage = step % STAGES
        k_step = step % k_steps
        # the next step's x (K step 0 again after a tile's last), requested a step ahead: the L2 round trip
        # overlaps this step's wait and arithmetic instead of stalling it
        if NORM:
            na, nb, nc, nd = _smem_x_words(x_smem, (step + 1) % k_steps, GROUPS, CHUNKS, ROWS, row_layout)
        else:
            next_rows = ((step + 1) % k_steps) * (GROUPS * GROUP_ROWS) + tile_rows
            na, nb, nc, nd = _x_words(x_ptr, next_rows, K, EVEN_K)
        mbarrier.wait(full.index(stage), (step // STAGES) & 1)
        words = codes.index(stage).reshape([GROUPS, CHUNKS, ROWS, BLOCK_N]).load(layout)
        scale = scales.index(stage).reshape([GROUPS, BLOCK_N]).load(group_layout).to(gl.float32)
        if READ_ZEROS:
            zero = zeros.index(stage).reshape([GROUPS, BLOCK_N]).load(group_layout).to(gl.float32)
        else:
            zero = gl.full([GROUPS, BLOCK_N], SHARED_ZERO, gl.float32, group_layout)
        gl.thread_barrier()   # every warp holds the stage: it may be refilled
        if step + STAGES < total:
            _issue(step + STAGES, codes_desc, scales_desc, zeros_desc, codes, scales, zeros, full, pid,
                   num_programs, k_steps, tiles_per_row, STAGES, READ_ZEROS)
        if HALF:
            acc += _half_step(words, xa, xb, xc, xd, scale, zero, IS_BF16, FRACTIONAL_ZEROS)
        else:
            acc += _fp32_step(words, xa, xb, xc, xd, scale, zero, IS_BF16)
        xa, xb, xc, xd = na, nb, nc, nd
        if k_step == k_steps - 1:
            head, n0 = _tile_origin(pid + (step // k_steps) * num_programs, tiles_per_row, WIDTH)
            kv = (k_cache_ptr, v_cache_ptr, slot_ptr, cache_stride_block, cache_stride_row, cache_stride_head,
                  q_heads, kv_heads)
            _store_tile(y_ptr, acc, y_buffer, head, n0, N, positions_ptr, cos_sin_ptr, cos_sin_stride, rotated_heads,
                        kv, out_layout, EPILOGUE, BLOCK_N, WARPS_G * WARPS_N, WRITE_KV, KV_BLOCK)
            acc = gl.zeros([GROUPS, CHUNKS, BLOCK_N], gl.float32, chunk_layout)
    if RESERVE > 0:   # a use at the end: the buffer is live all along, so nothing else is placed in it
        reserve.slice(0, 32).store(gl.zeros([32], gl.int32, gl.BlockedLayout([1], [32], [WARPS_G * WARPS_N], [0])))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(s))


GROUP_SIZES = (32, 64, 128)   # a group's word rows (4, 8 or 16) divide a stage and a thread's rows


@functools.lru_cache(maxsize=None)
def _shared_layout(bits: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=4)


@functools.lru_cache(maxsize=None)
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


NORM_MAX_K = 16384   # the staged, normed row: 2 K bytes of shared memory a program


def _row_like(t: torch.Tensor, x: torch.Tensor) -> bool:
    """A row the kernel reads or writes as 32-bit words beside x: contiguous, aligned, x's dtype and width."""
    return t.dtype == x.dtype and t.is_contiguous() and t.data_ptr() % 4 == 0 and t.numel() == x.shape[1]


def supported(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int, gated: bool = False, norm: RowNorm | None = None) -> bool:
    """Whether the kernel serves this call: one row of 16-bit x on an sm_90 GPU; TMA's 16-byte alignment of
    the weights' bases and row strides (gated: also of each half's start); a norm's weights, residual and
    stream rows like x (`_row_like`), x within NORM_MAX_K."""
    if x.device.type != "cuda" or x.shape[0] != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if group_size not in GROUP_SIZES or not _is_hopper(x.device.index or 0):
        return False
    if gated and qweight.shape[1] % 16:
        return False
    if norm is not None and (x.shape[1] > NORM_MAX_K or not _row_like(norm.weight, x) or (
            norm.residual is not None and not (_row_like(norm.residual, x) and _row_like(norm.stream, x)))):
        return False
    return all(t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (qweight, scales, zeros))


@functools.lru_cache(maxsize=None)
def _sm_shared_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_multiprocessor


CTA_RESERVED_BYTES = 1024   # the shared memory the hardware sets aside for each resident CTA (sm_80 on)


def shared_bytes(config: TmaGemvConfig, group_rows: int, scale_bytes: int, zero_bytes: int, x_steps: int) -> int:
    """What the kernel's buffers take in shared memory: the ring (codes, scales, zeros where read, a barrier a
    stage), y's tile and, normed (x_steps > 0), the staged row; the compiler adds under 2 KB of scratch."""
    rows = config.groups * group_rows
    stage = rows * config.block_n * 4 + config.groups * config.block_n * (scale_bytes + zero_bytes) + 8
    return config.stages * stage + config.block_n * 4 + x_steps * 4 * rows * 4


def reserved_bytes(config: TmaGemvConfig, used: int, sm_bytes: int) -> int:
    """Shared memory a program holds beyond `used` (a power of two: the allocation's granule) so that an SM holding
    `per_sm` of them has no room for a program of another GEMV. Two or more an SM: the most that leaves room for
    them and 2 KB of scratch each (over 100 KB a program at the H100's candidates). One an SM: the least that takes
    it 16 KB past half the SM, so that neither such a program nor one of those fits beside it, while the attention
    kernels' small programs still do (holding all the SM instead read 0.6% slower).
    Under PDL the next kernel launches once this one is past its wait, and each of its programs that finds room
    starts its ring's copies at once: the stream this kernel is finishing then shares HBM with bytes not needed
    yet. Register use kept them apart by chance (a symmetric GEMV's fewer registers let them in: 4% slower
    batch-1 steps on the H100); this keeps them apart by design, and the next GEMV's program starts on an SM as
    this one's leaves it."""
    if config.per_sm > 1:
        room = sm_bytes // config.per_sm - CTA_RESERVED_BYTES - used - 2048
        return 1 << (room.bit_length() - 1) if room >= 4096 else 0
    short = sm_bytes // 2 + (16 << 10) - used
    return 1 << (short - 1).bit_length() if short > 0 else 0


def programs(num_tiles: int, sms: int) -> int:
    """Programs for `num_tiles` whole-K tiles: as many waves as needed, each program with the same count."""
    waves = triton.cdiv(num_tiles, sms)
    return triton.cdiv(num_tiles, waves)


class KVWrite(NamedTuple):
    """The paged KV cache the EPILOGUE_ROTARY tile also stores the token's k and v heads into (kernels/kv_write.py's
    layout: [blocks, block_size, kv_heads, head_dim] in x's dtype) at slot_mapping [1] (-1: not stored); the
    last 2 * kv_heads heads of the product are k's, then v's."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_heads: int


class Rotary(NamedTuple):
    """What the EPILOGUE_ROTARY tile needs: the token's position [1], the cos | sin table [positions, head_dim]
    (fp32, layers/rotary.py), the head size, and how many heads from the first are rotated (q and k; v after);
    kv_cache, where given, the cache the k and v heads also go to (`KVWrite`)."""
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    head_dim: int
    rotated_heads: int
    kv_cache: KVWrite | None = None


def kv_write_supported(x: torch.Tensor, kv: KVWrite, head_dim: int) -> bool:
    """Whether the rotary tile can store into `kv`: caches in x's dtype (not fp8, whose scales it does not
    apply), alike in shape and strides, dense rows of head_dim; one slot."""
    k, v = kv.k_cache, kv.v_cache
    return (k.dtype == v.dtype == x.dtype and k.shape == v.shape and k.stride() == v.stride() and k.dim() == 4
            and k.shape[2:] == (kv.kv_heads, head_dim) and k.stride(3) == 1 and kv.slot_mapping.numel() == 1)


def int4_gemv_tma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, config: TmaGemvConfig, gated: bool = False, rotary: Rotary | None = None,
                  norm: RowNorm | None = None, zero_point: int | None = None) -> torch.Tensor:
    """y [1, N] = x [1, K] @ W in x's dtype (`supported` must hold). gated: W's columns are two halves (gate_up:
    gate, then up) and y [1, N / 2] = silu(x @ W_gate) * (x @ W_up), each tile BLOCK_N / 2 columns of both.
    rotary: W's columns are heads of `rotary.head_dim` (qkv_proj) and y has the first `rotary.rotated_heads`
    rotated at the position (neox pairs d, d + head_dim / 2 in one tile). norm: the product is RMSNorm(x) @ W,
    or RMSNorm(x + norm.residual) @ W with x + norm.residual written to norm.stream (any epilogue). zero_point:
    the zero point every group has (symmetric weights: `zeros` is all of it), which the kernel then takes as a
    constant instead of streaming `zeros` (1/34 of an int4 group's bytes at group 128)."""
    K = x.shape[1]
    group_rows = group_size // 8
    split = layout_split(config, group_rows)
    if split is None:
        raise ValueError(f"{config} does not divide a tile of group size {group_size}")
    threads_g, threads_r, threads_n, warps_g, warps_n = split
    if x.stride(1) != 1 or x.data_ptr() % 4:
        x = x.clone(memory_format=torch.contiguous_format)   # read as 32-bit pairs: a fresh allocation is aligned
    total = qweight.shape[1]
    if rotary is not None:
        half = rotary.head_dim // 2
        if total % rotary.head_dim or half % (config.block_n // 2):
            raise ValueError(f"{config} does not tile heads of {rotary.head_dim} columns")
        heads, halves, N, epilogue = total // rotary.head_dim, 2, half, EPILOGUE_ROTARY
    elif gated:
        heads, halves, N, epilogue = 1, 2, total // 2, EPILOGUE_SILU_AND_MUL
    else:
        heads, halves, N, epilogue = 1, 1, total, EPILOGUE_STORE
    y = torch.empty(1, total // 2 if gated else total, device=x.device, dtype=x.dtype)
    rows = config.groups * group_rows
    width = config.block_n // halves

    def descriptor(t, box_rows):   # [rows, heads, halves, N]: a tile's paired columns land side by side
        row = t.stride(0)   # a dimension of size 1 takes the row's stride: TMA wants every stride 16-byte aligned
        return TensorDescriptor(t, [t.shape[0], heads, halves, N], [row, halves * N if heads > 1 else row,
                                                                    N if halves > 1 else row, 1],
                                [box_rows, 1, halves, width], _shared_layout(8 * t.element_size()))

    tiles_per_row = triton.cdiv(N, width)
    num_tiles = heads * tiles_per_row
    x_steps = triton.next_power_of_2(triton.cdiv(K, rows * 8)) if norm is not None else 0
    zero_bytes = 0 if zero_point is not None else zeros.element_size()
    used = shared_bytes(config, group_rows, scales.element_size(), zero_bytes, x_steps)
    reserve = reserved_bytes(config, used, _sm_shared_bytes(x.device.index or 0))
    pdl = pdl_mode(x.device)
    grid = (programs(num_tiles, config.per_sm * num_sms(x.device)),)
    positions, cos_sin = (rotary.positions, rotary.cos_sin_cache) if rotary is not None else (y, y)
    kv = rotary.kv_cache if rotary is not None else None
    if kv is not None and not kv_write_supported(x, kv, rotary.head_dim):
        raise ValueError("the KV cache the rotary tile writes must be in x's dtype, [blocks, block_size, kv_heads, "
                         "head_dim] with dense rows, for one slot")
    kv_args = (kv.k_cache, kv.v_cache, kv.slot_mapping, *kv.k_cache.stride()[:3], rotary.rotated_heads - kv.kv_heads,
               kv.kv_heads) if kv is not None else (y, y, y, 0, 0, 0, 0, 0)
    _int4_gemv_tma_kernel[grid](
        x, descriptor(qweight, rows), descriptor(scales, config.groups),
        descriptor(zeros, config.groups) if zero_point is None else None, y, N, K,
        num_tiles, tiles_per_row, positions, cos_sin, cos_sin.stride(0), rotary.rotated_heads if rotary else 0,
        x if norm is None else norm.weight, norm.eps if norm else 0.0,
        *((x, x) if norm is None or norm.residual is None else (norm.residual, norm.stream)), *kv_args,
        STAGES=config.stages, GROUP_ROWS=group_rows, COLUMNS=config.columns, ROWS=config.rows,
        THREADS_G=threads_g, THREADS_R=threads_r, THREADS_N=threads_n, WARPS_G=warps_g, WARPS_N=warps_n,
        IS_BF16=x.dtype == torch.bfloat16, EVEN_K=K % (rows * 8) == 0, HALF=config.half,
        FRACTIONAL_ZEROS=zero_point is None and zeros.dtype == torch.float32, EPILOGUE=epilogue, NORM=norm is not None,
        ADD_RESIDUAL=norm is not None and norm.residual is not None,
        X_STEPS=max(x_steps, 1),
        WRITE_KV=kv is not None, KV_BLOCK=kv.k_cache.shape[1] if kv is not None else 1,
        SHARED_ZERO=None if zero_point is None else int(zero_point), RESERVE=reserve, PDL=pdl,
        num_warps=config.num_warps, **({"launch_pdl": True} if pdl else {}))
    return y
