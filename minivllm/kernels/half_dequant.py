"""4-bit codes to bf16 / fp16 weights two at a time, for the weight-only GEMM tiles that feed an MMA.

Converting each code with an integer-to-float instruction (a quarter of the FMA rate), applying the zero
point and scale in fp32 and rounding to 16 bits again (another conversion) kept the int4 MMA tiles at a
quarter of the copy bandwidth on the H100. Here a pair of codes goes straight into a 32-bit register of two
16-bit floats: the code sits in the low mantissa bits of 128.0 (bf16, 0x4300) or 1024.0 (fp16, 0x6400), whose
last mantissa bit is worth exactly 1, so one permute and one LOP3 give the pair (magic + q); one packed FMA
subtracts the magic (exact) and a second gives q * s - z * s. The result can differ from the reference's
round((q - z) * s) by the rounding of z * s to 16 bits (below the bf16 tolerance; none when z = 0). bf16 has
7 mantissa bits, so this holds for codes below 128: the callers use it for 4-bit codes only.
Under the interpreter (no inline PTX) the same formula runs in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl


def _pair_asm(kind: str, magic: int, one: int, minus_magic: int) -> str:
    return ("{ .reg .b32 t, one, minus;\n"
            f"mov.b32 one, {one:#010x};\n"
            f"mov.b32 minus, {minus_magic:#010x};\n"
            "prmt.b32 t, $1, $2, 0x5410;\n"                   # the low halves of the two words
            f"lop3.b32 t, t, 0x000f000f, {magic:#010x}, 0xEA;\n"   # (t & 0x000F000F) | magic
            f"fma.rn.{kind} t, t, one, minus;\n"              # q, exactly
            f"fma.rn.{kind} $0, t, $3, $4; }}")               # q * s - z * s


_ASM_BF16 = tl.constexpr(_pair_asm("bf16x2", 0x43004300, 0x3F803F80, 0xC300C300))
_ASM_FP16 = tl.constexpr(_pair_asm("f16x2", 0x64006400, 0x3C003C00, 0xE400E400))


@triton.jit
def dequantize_pairs(shifted, scale, neg_zero_scale, ASM: tl.constexpr):
    """Weights q * scale + neg_zero_scale in scale's dtype (bf16 or fp16), q = shifted & 15; `scale` and
    `neg_zero_scale` (= -zero * scale, in that dtype) broadcast to `shifted`'s shape."""
    scale = tl.broadcast_to(scale, shifted.shape)
    neg_zero_scale = tl.broadcast_to(neg_zero_scale, shifted.shape)
    if ASM:
        if scale.dtype == tl.bfloat16:
            return tl.inline_asm_elementwise(_ASM_BF16, "=r,r,r,r,r", [shifted, scale, neg_zero_scale],
                                             dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_ASM_FP16, "=r,r,r,r,r", [shifted, scale, neg_zero_scale],
                                             dtype=tl.float16, is_pure=True, pack=2)
    else:
        q = (shifted & 15).to(tl.float32)
        return (q * scale.to(tl.float32) + neg_zero_scale.to(tl.float32)).to(scale.dtype)
