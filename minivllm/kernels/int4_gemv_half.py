"""The int4 GEMV (one row of 16-bit x, 4-bit codes in our layout) in packed-half arithmetic.

The fp32 GEMV (`int4_gemm._int4_gemv_kernel`) spends one LOP3 and one FFMA per weight and a shift per two; its
compiled loop runs about 4.1 instructions per weight. Here two weights share each instruction, as f16x2:
- one LOP3 puts fields j and j + 4 of a word (bits 0-3 and 16-19) in the low mantissa bits of two halves of
  4.0, whose last bit is worth 1 / 256: t = 4 + q / 256 exactly. Fields 1 and 5 are used where they sit (4 + 16 q
  / 256), and one shift by 8 serves fields 2/6 and 3/7;
- one packed subtraction of c = 4 + z / 256 (for the fields four bits up, one packed FMA by 1 / 16 adding -c)
  gives (q - z) / 256, centred, so the fp16 sums below hold no large offset that would cancel later;
- one packed FMA adds x (x[k], x[k + 4] as fp16, formed from 32-bit loads of two values each) times that to an
  f16x2 sum per word; a K step's words are summed in f16x2 (a step lies inside one group: BLOCK_K weights a
  column, 64 in the tiles the H100 sweep chose), then the two halves in fp32, and y += 256 s * sum.
The compiled loop runs 2.3-2.5 instructions per weight (sm_90). fp16 sums over one step stay within bf16's
rounding of y on random data with outliers (4,096 x 256: 0.9e-3 of max |y|
against bf16's 1.6e-3; uncentred, 0.17). Zero points that are not integers (GGUF's -m / d, kept in fp32) round c to fp16;
with FRACTIONAL_ZEROS the step's x sums correct that. Range: x beyond fp16's 65,504, or a step's sum
beyond it (|x| above about 17,000 with 4-bit zero points), would overflow; decode activations stay far below.
Under the interpreter (no inline PTX) the same packed values are formed with integer ops and rounded to fp16
after each op.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from minivllm.kernels.pdl import prefetch_word_rows, wait_for_previous
from minivllm.kernels.split_k import split_k_tile, store_row_slice

_ASM_ON = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")   # for the reduction's combine function
_LOW = tl.constexpr(0x000F000F)    # fields 0 and 4 of a word: bits 0-3 and 16-19
_HIGH = tl.constexpr(0x00F000F0)   # fields 1 and 5: bits 4-7 and 20-23
_MAGIC = tl.constexpr(0x44004400)  # 4.0 in each half: its last mantissa bit is worth 1 / 256


def _word_asm() -> str:
    """Inputs: the word, x's four pairs (fields 0/4, 1/5, 2/6, 3/7), the low centre and the negated high centre
    as f16x2, the sum so far. The high fields sit 4 bits up: 4 + 16 q / 256, scaled by 1 / 16 in an FMA that
    adds the negated centre."""
    lines = ["{ .reg .b32 t, a, w, sixteenth;", "mov.b32 sixteenth, 0x2C002C00;"]
    for j in range(4):
        src = "$1" if j < 2 else "w"
        if j == 2:
            lines.append("shr.u32 w, $1, 8;")
        if j % 2 == 0:
            lines += [f"lop3.b32 t, {src}, {_LOW.value:#010x}, {_MAGIC.value:#010x}, 0xEA;", "sub.f16x2 t, t, $6;"]
        else:
            lines += [f"lop3.b32 t, {src}, {_HIGH.value:#010x}, {_MAGIC.value:#010x}, 0xEA;",
                      "fma.rn.f16x2 t, t, sixteenth, $7;"]
        lines.append(f"fma.rn.f16x2 {'$0' if j == 3 else 'a'}, ${2 + j}, t, {'$8' if j == 0 else 'a'};")
    return "\n".join(lines) + " }"


WORD_ASM = tl.constexpr(_word_asm())

# two 32-bit words of 16-bit x (x[k], x[k + 1]) and (x[k + 4], x[k + 5]) -> f16x2 pairs (x[k], x[k + 4]) and
# (x[k + 1], x[k + 5]) (cvt.rn.f16x2.f32 d, a, b puts a in the upper half)
PAIRS_BF16 = tl.constexpr(
    "{ .reg .b32 l0, l1, h0, h1;\n"
    "shl.b32 l0, $2, 16; shl.b32 l1, $3, 16;\n"
    "and.b32 h0, $2, 0xFFFF0000; and.b32 h1, $3, 0xFFFF0000;\n"
    "cvt.rn.f16x2.f32 $0, l1, l0; cvt.rn.f16x2.f32 $1, h1, h0; }")
PAIRS_FP16 = tl.constexpr("prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;")
# f16x2 -> the fp32 sum of its halves; f16x2 + f16x2; fp32 -> f16x2 (v, v). Shared with kernels/int4_gemv_tma.py.
HALVES_SUM_ASM = tl.constexpr(
    "{ .reg .f16 l, h; .reg .f32 a, b; mov.b32 {l, h}, $1; cvt.f32.f16 a, l; cvt.f32.f16 b, h; add.f32 $0, a, b; }")
ADD_HALVES_ASM = tl.constexpr("add.f16x2 $0, $1, $2;")
SPLAT_HALF_ASM = tl.constexpr("cvt.rn.f16x2.f32 $0, $1, $1;")


# ---- the packed-half values under the interpreter: two fp16 bit patterns in an int32 -----------------------
@triton.jit
def _low(v):
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _high(v):
    return (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pack(lo, hi):
    lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo_bits | (hi_bits << 16)


@triton.jit
def _x16(word, HIGH: tl.constexpr, IS_BF16: tl.constexpr):
    """The low or high 16-bit x of a 32-bit word, in fp32."""
    if IS_BF16:
        if HIGH:
            return (word & -65536).to(tl.float32, bitcast=True)
        else:
            return (word << 16).to(tl.float32, bitcast=True)
    elif HIGH:
        return _high(word)
    else:
        return _low(word)


@triton.jit
def _x_pairs(word_a, word_b, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """(x[k], x[k + 1]) and (x[k + 4], x[k + 5]) as words -> f16x2 (x[k], x[k + 4]), (x[k + 1], x[k + 5])."""
    if ASM:
        if IS_BF16:
            return tl.inline_asm_elementwise(PAIRS_BF16, "=r,=r,r,r", [word_a, word_b],
                                             dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(PAIRS_FP16, "=r,=r,r,r", [word_a, word_b],
                                             dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        first = _pack(_x16(word_a, False, IS_BF16), _x16(word_b, False, IS_BF16))
        second = _pack(_x16(word_a, True, IS_BF16), _x16(word_b, True, IS_BF16))
        return first, second


@triton.jit
def _add_word(words, p0, p1, p2, p3, low_centre, neg_high_centre, acc, ASM: tl.constexpr):
    """acc + sum over the word's 8 fields of x * (q - z) / 256, in f16x2 (fields j and j + 4 in the halves)."""
    if ASM:
        return tl.inline_asm_elementwise(WORD_ASM, "=r,r,r,r,r,r,r,r,r",
                                         [words, p0, p1, p2, p3, low_centre, neg_high_centre, acc],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        lo, hi = _low(acc), _high(acc)
        for j in tl.static_range(4):
            t = ((words >> (8 * (j // 2))) & (_LOW if j % 2 == 0 else _HIGH)) | _MAGIC
            p = p0 if j == 0 else p1 if j == 1 else p2 if j == 2 else p3
            c = low_centre if j % 2 == 0 else neg_high_centre
            f = 1.0 if j % 2 == 0 else 0.0625
            sign = -1.0 if j % 2 == 0 else 1.0
            # each packed op rounds to fp16 (exact here); products of two fp16 values are exact in fp32
            w_lo = (_low(t) * f + sign * _low(c)).to(tl.float16).to(tl.float32)
            w_hi = (_high(t) * f + sign * _high(c)).to(tl.float16).to(tl.float32)
            lo = (_low(p) * w_lo + lo).to(tl.float16).to(tl.float32)
            hi = (_high(p) * w_hi + hi).to(tl.float16).to(tl.float32)
        return _pack(lo, hi)


@triton.jit
def _halves_sum(acc, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise(HALVES_SUM_ASM, "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return _low(acc) + _high(acc)


@triton.jit
def _add_halves(a, b):
    """f16x2 a + b (the reduction over a step's word rows)."""
    if _ASM_ON:
        return tl.inline_asm_elementwise(ADD_HALVES_ASM, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return _pack(_low(a) + _low(b), _high(a) + _high(b))


@triton.jit
def _splat_half(v, ASM: tl.constexpr):
    """fp32 v -> f16x2 (v, v)."""
    if ASM:
        return tl.inline_asm_elementwise(SPLAT_HALF_ASM, "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return _pack(v, v)


@triton.jit
def int4_gemv_half_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, y_ptr, tickets_ptr, N, K,
                          group_size, k_per_split, stride_xm, stride_qk, stride_sg, stride_os, stride_om,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_BF16: tl.constexpr,
                          FRACTIONAL_ZEROS: tl.constexpr, ASM: tl.constexpr,
                          FUSED_SUM: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
                          PREFETCH_WORDS: tl.constexpr, PDL: tl.constexpr):
    """One row of x per program (grid: rows, N tiles, K slices); BLOCK_K divides the group size, x's row
    stride is even and its base 4-byte aligned (x read as 32-bit words). FRACTIONAL_ZEROS: zero points that
    are not integers (GGUF's -m / d, kept in fp32), whose fp16 centre needs the correction."""
    _, offs_n, _, mask_n, k_start, k_end = split_k_tile(1, N, K, k_per_split, 1, BLOCK_N)
    if PREFETCH_WORDS > 0:   # the first word rows load while the previous kernel runs
        prefetch_word_rows(qweight_ptr, k_start, k_end, N, stride_qk, BLOCK_N, PREFETCH_WORDS, PDL)
    wait_for_previous(PDL)
    x_words = (x_ptr + tl.program_id(0) * stride_xm).to(tl.pointer_type(tl.int32))
    WORDS: tl.constexpr = BLOCK_K // 8
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        offs_w = k0 // 8 + tl.arange(0, WORDS)
        if EVEN:
            words = tl.load(qweight_ptr + offs_w[:, None] * stride_qk + offs_n[None, :])
            xa = tl.load(x_words + offs_w * 4)   # x[8w .. 8w + 1], then 2-3, 4-5, 6-7
            xb = tl.load(x_words + offs_w * 4 + 1)
            xc = tl.load(x_words + offs_w * 4 + 2)
            xd = tl.load(x_words + offs_w * 4 + 3)
        else:
            words = tl.load(qweight_ptr + offs_w[:, None] * stride_qk + offs_n[None, :],
                            mask=(offs_w[:, None] * 8 < k_end) & mask_n[None, :], other=0)
            # x beyond K reads as zero (a word holds two x: K is even, as the group size is)
            xa = tl.load(x_words + offs_w * 4, mask=offs_w * 8 < k_end, other=0)
            xb = tl.load(x_words + offs_w * 4 + 1, mask=offs_w * 8 + 2 < k_end, other=0)
            xc = tl.load(x_words + offs_w * 4 + 2, mask=offs_w * 8 + 4 < k_end, other=0)
            xd = tl.load(x_words + offs_w * 4 + 3, mask=offs_w * 8 + 6 < k_end, other=0)
        p0, p1 = _x_pairs(xa, xc, IS_BF16, ASM)
        p2, p3 = _x_pairs(xb, xd, IS_BF16, ASM)
        group = k0 // group_size
        scale = tl.load(scales_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        exact_low, exact_high = 4.0 + zero / 256.0, 0.25 + zero / 256.0
        low_centre, neg_high_centre = _splat_half(exact_low, ASM), _splat_half(-exact_high, ASM)
        acc = _add_word(words, p0[:, None], p1[:, None], p2[:, None], p3[:, None], low_centre[None, :],
                        neg_high_centre[None, :], tl.zeros((WORDS, BLOCK_N), dtype=tl.int32), ASM)
        column = _halves_sum(tl.reduce(acc, 0, _add_halves), ASM)
        if FRACTIONAL_ZEROS:   # the centres' rounding to fp16 (none for integer zero points below 1024)
            low_x = tl.sum(_halves_sum(p0, ASM) + _halves_sum(p2, ASM), axis=0)
            high_x = tl.sum(_halves_sum(p1, ASM) + _halves_sum(p3, ASM), axis=0)
            column -= (exact_low - _halves_sum(low_centre, ASM) * 0.5) * low_x
            column -= (exact_high + _halves_sum(neg_high_centre, ASM) * 0.5) * high_x
        total += (256.0 * scale) * column
    store_row_slice(out_ptr, y_ptr, tickets_ptr, total, offs_n, mask_n, N, stride_os, stride_om, FUSED_SUM)
