"""The Triton weight-only GEMM against its dequantize + matmul reference, on odd shapes (K not a
multiple of the tile, a ragged last group, N not a multiple of the tile), with and without split-K.
Under TRITON_INTERPRET=1 without CUDA; the `gpu` test uses 8B layer shapes in bf16."""
import itertools
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from minivllm.kernels import int4_gemm  # noqa: E402,F401  (applies the interpreter fix first)
from minivllm.kernels.int4_gemm import (DEQUANTIZE_FROM_M, GemmConfig, GemvConfig, TmaGemvConfig,  # noqa: E402
                                        dequantize_triton, weight_only_gemm, weight_only_gemm_reference)
from minivllm.kernels.quant_rows import FP8, quantize_rows_reference, quantize_rows_triton  # noqa: E402
from minivllm.quantization.packing import dequantize as dequantize_reference  # noqa: E402
from minivllm.quantization.packing import pack_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_weights(K, N, group_size, bits, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    groups = -(-K // group_size)
    codes = torch.randint(0, 1 << bits, (K, N), generator=generator)
    scales = (torch.rand(groups, N, generator=generator) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 1 << bits, (groups, N), generator=generator).to(dtype)
    return pack_rows(codes, bits).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


@pytest.mark.parametrize("M,K,N,group_size,bits,split_k", [
    (1, 200, 72, 64, 4, 1), (5, 200, 72, 64, 4, 2), (3, 392, 40, 128, 4, 3),
    (33, 136, 24, 32, 4, None), (7, 96, 48, 32, 8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_only_gemm_matches_reference(M, K, N, group_size, bits, split_k, dtype):
    qweight, scales, zeros = random_weights(K, N, group_size, bits, dtype)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    ours = weight_only_gemm(x, qweight, scales, zeros, group_size, bits, split_k=split_k)
    reference = weight_only_gemm_reference(x.float(), qweight, scales, zeros, group_size, bits)
    assert ours.dtype == dtype and ours.shape == (M, N)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(ours.float(), reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())


@pytest.mark.parametrize("config", [GemmConfig(1, 32, 64, 4, 2), GemmConfig(1, 16, 128, 2, 2),
                                    GemmConfig(16, 32, 32, 4, 2), GemmConfig(32, 16, 64, 4, 3)])
@pytest.mark.parametrize("M,group_size", [(1, 64), (3, 128), (18, 32)])
def test_weight_only_gemm_tile_configs(config, M, group_size):
    """Every tile shape the sweep may pick: one-row and MMA tiles, a step inside one group (its scales
    loaded once) or spanning several, split-K, a ragged last group."""
    qweight, scales, zeros = random_weights(200, 40, group_size, 4, torch.float32, seed=M)
    x = torch.randn(M, 200, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    reference = weight_only_gemm_reference(x, qweight, scales, zeros, group_size, 4)
    for split_k in (1, 2):
        ours = weight_only_gemm(x, qweight, scales, zeros, group_size, 4, split_k=split_k, config=config)
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


@pytest.mark.parametrize("config", [GemvConfig(32, 64, 4, 2), GemvConfig(16, 32, 1, 2, fused_sum=True),
                                    GemvConfig(64, 128, 2, 3, fused_sum=True)])
@pytest.mark.parametrize("M,K,N,group_size,x_offset", [(1, 200, 72, 64, 0), (3, 392, 40, 128, 0),
                                                       (2, 136, 24, 32, 1), (1, 256, 40, 128, 0),
                                                       (1, 512, 128, 128, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_gemv_matches_reference(config, M, K, N, group_size, x_offset, dtype):
    """The one-row-per-program int4 kernel (codes read through a float's mantissa, scales applied per K step):
    ragged K inside a word and a group, N beyond the tile, and shapes the tiles divide (loads without masks);
    split-K summed by a second kernel or by each tile's last slice (twice: the tickets are reset, the sum is
    deterministic); a tile wider than the group is refused. bf16 x is read two values per 32-bit load, unless
    the row starts off a 4-byte boundary (x_offset)."""
    qweight, scales, zeros = random_weights(K, N, group_size, 4, dtype, seed=M)
    storage = torch.randn(M * K + x_offset, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    x = storage[x_offset:].view(M, K)
    check_gemv_tile(config, x, qweight, scales, zeros, group_size, 1e-4 if dtype == torch.float32 else 3e-3)


def check_gemv_tile(config, x, qweight, scales, zeros, group_size, tolerance):
    """A GEMV tile against the reference with split-K 1 and 3, each twice (bit-identical: the tickets are reset,
    the sum is deterministic); a tile wider than the group is refused."""
    reference = weight_only_gemm_reference(x.float(), qweight, scales, zeros, group_size, 4)
    if group_size % config.block_k:
        with pytest.raises(ValueError):
            weight_only_gemm(x, qweight, scales, zeros, group_size, 4, split_k=1, config=config)
        return
    for split_k in (1, 3):
        ours = weight_only_gemm(x, qweight, scales, zeros, group_size, 4, split_k=split_k, config=config)
        assert ours.dtype == x.dtype and ours.shape == (x.shape[0], qweight.shape[1])
        torch.testing.assert_close(ours.float(), reference, rtol=tolerance,
                                   atol=tolerance * reference.abs().max().item())
        again = weight_only_gemm(x, qweight, scales, zeros, group_size, 4, split_k=split_k, config=config)
        assert torch.equal(again, ours)


HALF_TILES = [GemvConfig(32, 64, 1, 2, fused_sum=True, half=True), GemvConfig(64, 32, 2, 2, half=True),
              GemvConfig(32, 128, 1, 3, fused_sum=True, half=True)]
HALF_CASES = [(1, 200, 72, 64, 0), (3, 392, 40, 128, 1), (2, 136, 24, 32, 0), (1, 512, 128, 128, 0)]


def check_half_gemv(config, M, K, N, group_size, x_offset, dtype, fractional):
    qweight, scales, zeros = random_weights(K, N, group_size, 4, dtype, seed=M + K)
    if fractional:   # GGUF's kernel form: zero = -m / d in fp32, off the integers and outside the code range
        zeros = (torch.rand(zeros.shape, generator=torch.Generator().manual_seed(7)) * 40 - 12).to(DEVICE)
    storage = (torch.randn(M * K + x_offset, generator=torch.Generator().manual_seed(5)) * 2).to(dtype).to(DEVICE)
    storage[x_offset + 7] = 300.0   # an outlier channel, as real activations have
    x = storage[x_offset:].view(M, K)
    check_gemv_tile(config, x, qweight, scales, zeros, group_size, 3e-3)


@pytest.mark.parametrize("config,M,K,N,group_size,x_offset,dtype,fractional", [
    pytest.param(HALF_TILES[0], 1, 200, 72, 64, 0, torch.bfloat16, False, marks=pytest.mark.long),
    pytest.param(HALF_TILES[2], 2, 264, 40, 128, 1, torch.float16, False, marks=pytest.mark.long),
    (HALF_TILES[1], 2, 136, 24, 32, 0, torch.bfloat16, True),
    (HALF_TILES[2], 1, 200, 72, 64, 0, torch.bfloat16, False)])   # BLOCK_K beyond the group: refused
def test_int4_gemv_half_matches_reference(config, M, K, N, group_size, x_offset, dtype, fractional):
    """The packed-half int4 GEMV (kernels/int4_gemv_half.py; under the interpreter its packed values formed and
    rounded to fp16 with plain ops, as the PTX does): ragged K inside a group, N beyond the tile, x off a 4-byte
    boundary (copied), an outlier in x, integer zero points in 16 bits and fractional ones in fp32 (the
    centres' rounding corrected), split-K summed by a second kernel or in the last slice, deterministic."""
    check_half_gemv(config, M, K, N, group_size, x_offset, dtype, fractional)


def test_int4_gemv_half_refuses_fp32_x():
    qweight, scales, zeros = random_weights(128, 32, 64, 4, torch.float32)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        weight_only_gemm(torch.randn(1, 128, device=DEVICE), qweight, scales, zeros, 64, 4, split_k=1,
                         config=HALF_TILES[0])


@pytest.mark.parametrize("config", [GemmConfig(16, 32, 32, 4, 2, True), GemmConfig(32, 16, 64, 4, 3, True),
                                    GemmConfig(16, 64, 32, 4, 3, True)])
@pytest.mark.parametrize("M,K,N,group_size,bits", [(18, 200, 40, 64, 4), (5, 136, 72, 32, 4), (7, 96, 24, 32, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fast_dequant_tiles_match_reference(config, M, K, N, group_size, bits, dtype):
    """MMA tiles forming the weights two at a time in 16 bits (kernels/half_dequant.py; its fp32 formula under
    the interpreter, the PTX on the GPU test below): rows, columns and K ragged against the tile, a ragged last
    group, split-K; a tile wider than the group, 8-bit codes or fp32 x are refused."""
    qweight, scales, zeros = random_weights(K, N, group_size, bits, dtype, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    reference = weight_only_gemm_reference(x.float(), qweight, scales, zeros, group_size, bits)
    if group_size % config.block_k or bits != 4 or dtype == torch.float32:
        with pytest.raises(ValueError):
            weight_only_gemm(x, qweight, scales, zeros, group_size, bits, split_k=1, config=config)
        return
    tolerance = 1e-4 if dtype == torch.float32 else 3e-3
    for split_k in (1, 3):
        ours = weight_only_gemm(x, qweight, scales, zeros, group_size, bits, split_k=split_k, config=config)
        assert ours.dtype == dtype and ours.shape == (M, N)
        torch.testing.assert_close(ours.float(), reference, rtol=tolerance,
                                   atol=tolerance * reference.abs().max().item())


@pytest.mark.parametrize("K,N,group_size,bits", [(200, 40, 64, 4), (136, 72, 32, 4), (96, 24, 32, 8)])
def test_dequantize_kernel_and_large_m_path(K, N, group_size, bits):
    """From DEQUANTIZE_FROM_M rows the GEMM expands W once (the kernel) and multiplies: same values."""
    qweight, scales, zeros = random_weights(K, N, group_size, bits, torch.float32)
    ours = dequantize_triton(qweight, scales, zeros, group_size, bits, K, torch.float32)
    assert torch.equal(ours.cpu(), dequantize_reference(qweight, scales, zeros, group_size, bits, K).cpu())
    x = torch.randn(DEQUANTIZE_FROM_M, K, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    reference = weight_only_gemm_reference(x, qweight, scales, zeros, group_size, bits)
    torch.testing.assert_close(weight_only_gemm(x, qweight, scales, zeros, group_size, bits), reference,
                               rtol=1e-4, atol=1e-4 * reference.abs().max().item())


@pytest.mark.parametrize("dtype", [FP8, torch.int8])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(6, 300), (3, 2500), (17, 1500)])   # (3, 2500): 3 chunks per row
def test_quantize_rows_kernel_is_exact(dtype, x_dtype, rows, cols):
    """W8A8's per-token activation quantization in one kernel: the reference's codes and scales bit for bit
    (int8 ties round to even, fp8 saturates at 448, an all-zero row gets the floor scale), with one program
    per row or, for few long rows, one per chunk of a row (the scale's outlier in another chunk)."""
    x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(4)) * 3).to(x_dtype)
    x[1] = 0
    x[2, :6] = torch.tensor([127.0, 63.5, -0.5, 1.5, 2.5, -2.5])   # int8 ties at scale 1
    x[2, cols - 1] = 127.0
    x[0, 0] = 1e4
    codes, scales = quantize_rows_triton(x.to(DEVICE), dtype)
    ref_codes, ref_scales = quantize_rows_reference(x, dtype)
    view = (lambda t: t.view(torch.uint8)) if dtype == FP8 else (lambda t: t)
    assert torch.equal(view(codes.cpu()), view(ref_codes)) and torch.equal(scales.cpu(), ref_scales)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 16, 64, 256])
@pytest.mark.parametrize("K,N", [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_weight_only_gemm_8b_shapes_bf16(M, K, N):
    """The tuned dispatch and every candidate tile it may choose."""
    from minivllm.kernels.int4_gemm import candidates
    qweight, scales, zeros = random_weights(K, N, 128, 4, torch.bfloat16)
    x = torch.randn(M, K, device=DEVICE).to(torch.bfloat16)
    reference = weight_only_gemm_reference(x.float(), qweight, scales, zeros, 128, 4)
    results = [weight_only_gemm(x, qweight, scales, zeros, 128, 4)]
    results += [weight_only_gemm(x, qweight, scales, zeros, 128, 4, split_k=c[1], config=c[0])
                for c in candidates(M, N, K, x.device, 128, 4) if c is not None and M < 128]
    for ours in results:
        torch.testing.assert_close(ours.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M,K,N,group_size,x_offset", HALF_CASES)
@pytest.mark.parametrize("dtype,fractional", [(torch.bfloat16, False), (torch.float16, False),
                                              (torch.bfloat16, True)])
def test_int4_gemv_half_ptx_matches_reference(M, K, N, group_size, x_offset, dtype, fractional):
    """The packed-half GEMV's PTX on the GPU, on the interpreter test's odd shapes."""
    for config in HALF_TILES:
        check_half_gemv(config, M, K, N, group_size, x_offset, dtype, fractional)


def test_cold_copies_exceed_l2():
    """The tuner times weights cold: copies (16 at most) that together exceed COLD_BYTES, same values."""
    from minivllm.kernels.tuning import COLD_BYTES, cold_copies
    small = (torch.arange(1 << 18, dtype=torch.int32), torch.ones(8))   # 1 MiB
    copies = cold_copies(small)
    assert len(copies) == 16 and copies[0][0] is small[0]
    assert len({c[0].data_ptr() for c in copies}) == 16 and all(torch.equal(c[0], small[0]) for c in copies)
    large = (torch.zeros(COLD_BYTES // 4 // 3 + 1, dtype=torch.int32),)   # a third of COLD_BYTES
    assert len(cold_copies(large)) == 3 and cold_copies(()) == [()]


def test_stored_choices_are_taken_by_repr_and_only_from_the_candidates(tmp_path, monkeypatch):
    """A key found in the device's configs file takes the stored candidate, a library path (None) included; a stored
    choice no longer among the candidates, another device, or MINIVLLM_TUNED_CONFIGS=0 leave the key to timing
    (`missing`, None by default)."""
    import json

    from minivllm.kernels import tuning
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tiles = [TmaGemvConfig(32, 16, 2, 4, rows=2, per_sm=2), TmaGemvConfig(32, 16, 3, 8, columns=4, rows=2)]
    key, other = ("weight_only", torch.bfloat16, 4, 128, 1, 4096, 4096), ("weight_only", torch.bfloat16, 4, 128, 1, 1, 1)
    assert tuning.config_file("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"
    tuning.config_file("Test GPU").write_text(json.dumps({"choices": {
        repr(key): repr((tiles[1], 1)), repr(other): repr((TmaGemvConfig(64, 8, 2, 4), 1))}}))
    candidates = [(tile, 1) for tile in tiles]
    assert tuning.stored_choice(key, candidates, "Test GPU") == (tiles[1], 1)
    assert tuning.stored_choice(other, candidates, "Test GPU") is None      # stored, but not a candidate now
    assert tuning.stored_choice(key, candidates, "Another GPU") is None     # no file for that device
    library = ("dense_gemv", torch.bfloat16, (576, 576), False, ("rows", 4))   # a stored library path (None)
    tuning.config_file("Library GPU").write_text(json.dumps({"choices": {repr(library): "None"}}))
    missing = object()
    assert tuning.stored_choice(library, [None, (1, 1024, 1)], "Library GPU", missing=missing) is None
    assert tuning.stored_choice(key, [None, (1, 1024, 1)], "Library GPU", missing=missing) is missing
    monkeypatch.setenv("MINIVLLM_TUNED_CONFIGS", "0")
    assert tuning.stored_choice(key, candidates, "Test GPU") is None


def test_shipped_choices_are_current_candidates():
    """Every choice in kernels/configs/ is the repr of a current candidate of its key: a Gluon GEMV tile (or it with
    split 1), or for a 16-bit GEMV key a tile of kernels/dense_gemv.py for its row count or cuBLAS (None), so a
    change of the candidates cannot silently leave a shipped file unused."""
    from minivllm.kernels import tuning
    from minivllm.kernels.dense_gemv import GEMV_TILES, rows_tiles
    from minivllm.kernels.int4_gemm import tma_gemv_tiles
    files = sorted(tuning.CONFIG_DIR.glob("*.json"))
    assert files, "no shipped configs"
    tiles = tma_gemv_tiles(1, 128, 4, torch.bfloat16, torch.device("cuda"))
    allowed = {repr(t) for t in tiles} | {repr((t, 1)) for t in tiles}
    for path in files:
        choices = tuning._stored_choices(path)
        assert choices, path.name
        for key, choice in choices.items():
            if key.startswith("('dense_gemv'"):
                rows = int(key.rsplit("('rows', ", 1)[1].split(")")[0]) if "('rows', " in key else 1
                dense = GEMV_TILES if rows == 1 else rows_tiles(rows)
                library = set() if "'norm'" in key else {"None"}   # cuBLAS is a candidate without a folded norm
                assert choice in {repr(t) for t in dense} | library, (path.name, key)
            else:
                assert choice in allowed, (path.name, key)


# ---- the Gluon GEMV (kernels/int4_gemv_tma.py): compiled for sm_90 here, run on the GPU ----------------------
def _shipped_tiles() -> list[TmaGemvConfig]:
    """The Gluon tiles that kernels/configs/ hands the engine without timing: the GPU tests run each of them too."""
    from minivllm.kernels.int4_gemv_tma import TMA_GEMV_TILES
    from minivllm.kernels.tuning import CONFIG_DIR, _stored_choices
    shipped = {v for path in CONFIG_DIR.glob("*.json") for v in _stored_choices(path).values()}
    return [t for t in TMA_GEMV_TILES if repr(t) in shipped or repr((t, 1)) in shipped]


TMA_TILES = [TmaGemvConfig(32, 8, 3, 8), TmaGemvConfig(16, 8, 2, 4, rows=2, per_sm=2),
             TmaGemvConfig(64, 8, 2, 4, columns=8, rows=8), TmaGemvConfig(32, 16, 2, 4, rows=1),
             TmaGemvConfig(16, 8, 2, 4, rows=2, per_sm=2, half=True), TmaGemvConfig(32, 16, 2, 4, rows=1, half=True)]
TMA_TILES += [t for t in _shipped_tiles() if t not in TMA_TILES]


def _compile_tma_gemv_for_sm90(config, group_size, dtype, zero_dtype, epilogue=0, norm=False, add=False, kv=False,
                               reserve=0):
    """PTX of the Gluon GEMV for sm_90 (in a fresh process: an interpreted Triton function earlier in the process
    leaves triton.language patched for the interpreter, and a Gluon compile after it fails); zero_dtype None: symmetric
    weights, every zero point 8 (no zeros read)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from minivllm.kernels import int4_gemv_tma as tma
    group_rows = group_size // 8
    threads_g, threads_r, threads_n, warps_g, warps_n = tma.layout_split(config, group_rows)
    K, N = 1024, 256

    heads, halves = (N // 128, 2) if epilogue == 2 else (1, 2 if epilogue == 1 else 1)
    width = N // heads // halves

    def descriptor(t, rows):
        return mangle_type(TensorDescriptor(t, [t.shape[0], heads, halves, width],
                                            [t.stride(0), halves * width, width, 1],
                                            [rows, 1, halves, config.block_n // halves],
                                            tma._shared_layout(8 * t.element_size())))
    pointer = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    signature = dict(x_ptr=pointer, codes_desc=descriptor(torch.zeros(K // 8, N, dtype=torch.int32),
                                                          config.groups * group_rows),
                     scales_desc=descriptor(torch.zeros(K // group_size, N, dtype=dtype), config.groups),
                     zeros_desc="constexpr" if zero_dtype is None else
                     descriptor(torch.zeros(K // group_size, N, dtype=zero_dtype), config.groups),
                     y_ptr=pointer, N="i32", K="i32", num_tiles="i32", tiles_per_row="i32", positions_ptr="*i64",
                     cos_sin_ptr="*fp32", cos_sin_stride="i32", rotated_heads="i32", norm_weight_ptr=pointer,
                     eps="fp32", residual_ptr=pointer, stream_ptr=pointer, k_cache_ptr=pointer, v_cache_ptr=pointer,
                     slot_ptr="*i64", cache_stride_block="i32", cache_stride_row="i32", cache_stride_head="i32",
                     q_heads="i32", kv_heads="i32")
    constants = dict(STAGES=config.stages, GROUP_ROWS=group_rows, COLUMNS=config.columns, ROWS=config.rows,
                     THREADS_G=threads_g, THREADS_R=threads_r, THREADS_N=threads_n, WARPS_G=warps_g,
                     WARPS_N=warps_n,
                     IS_BF16=dtype == torch.bfloat16, EVEN_K=False, HALF=config.half,
                     FRACTIONAL_ZEROS=zero_dtype == torch.float32, EPILOGUE=epilogue, NORM=norm, ADD_RESIDUAL=add,
                     X_STEPS=triton.next_power_of_2(triton.cdiv(K, config.groups * group_size)) if norm else 1,
                     WRITE_KV=kv, KV_BLOCK=16, SHARED_ZERO=8 if zero_dtype is None else None, RESERVE=reserve,
                     PDL=1)
    signature.update({name: "constexpr" for name in constants})
    if zero_dtype is None:
        constants["zeros_desc"] = None
    compiled = triton.compile(GluonASTSource(tma._int4_gemv_tma_kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=config.num_warps))
    return compiled.asm["ptx"], bool(compiled.asm["cubin"]), compiled.metadata.shared


@pytest.mark.parametrize("config,group_size,dtype,zero_dtype,epilogue,norm,add,kv", [
    (TMA_TILES[0], 128, torch.bfloat16, torch.bfloat16, 0, False, False, False),
    (TMA_TILES[3], 32, torch.float16, torch.float32, 1, True, True, False),
    (TMA_TILES[5], 64, torch.bfloat16, torch.float32, 2, True, False, False),
    (TMA_TILES[4], 128, torch.bfloat16, torch.bfloat16, 2, False, False, True),
    (TMA_TILES[2], 128, torch.bfloat16, None, 1, True, True, False),
    (TMA_TILES[4], 128, torch.float16, None, 2, True, False, True)])
def test_tma_gemv_compiles_to_tma_loads_before_the_pdl_wait(config, group_size, dtype, zero_dtype, epilogue, norm,
                                                            add, kv):
    """The kernel is what it claims: three TMA copies a stage (codes, scales, zeros; two for symmetric weights,
    whose zeros it does not read), the ring's first STAGES
    of them issued before griddepcontrol.wait and the rest inside the K loop after it; x read after the wait,
    the loop's x loads (the next step's) ahead of its stage wait, or, normed, the stream read once before the
    loop (the norm's weights before the wait; the residual after it, their sum stored once) and x from shared
    memory in it; the rotary epilogue's reads after the last stage (and the KV write's slot, its two stores to the
    cache after y's); one LOP3 per weight."""
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        ptx, has_cubin, _ = pool.apply(_compile_tma_gemv_for_sm90,
                                       (config, group_size, dtype, zero_dtype, epilogue, norm, add, kv))
    assert has_cubin
    lines = ptx.splitlines()
    copies = [i for i, line in enumerate(lines) if "cp.async.bulk.tensor.4d.shared::cluster.global" in line]
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    per_stage = 3 if zero_dtype is not None else 2
    assert len(copies) == per_stage * (config.stages + 1)
    assert sum(i < wait for i in copies) == per_stage * config.stages
    loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    stage_waits = [i for i, line in enumerate(lines) if "mbarrier.try_wait" in line]
    assert stage_waits
    ahead = [i for i in loads if i < wait]
    x_loads = [i for i in loads if wait < i < min(stage_waits)]
    in_loop = [i for i in loads if min(stage_waits) < i < max(stage_waits)]
    tail = [i for i in loads if i > max(stage_waits)]
    assert bool(ahead) == norm and x_loads and not in_loop
    assert any("rsqrt" in line for line in lines) == norm
    stores = [i for i, line in enumerate(lines) if "st.global" in line]
    assert any(wait < i < min(stage_waits) for i in stores) == add   # the stream's next value, before the loop
    # rotary: the position (64-bit), then cos and sin
    assert bool(tail) == (epilogue == 2)
    assert epilogue != 2 or (len(tail) >= 3 and "ld.global.b64" in lines[tail[0]])
    # the rotary tile's two halves to y, and with the KV write to the cache too, after the slot (64-bit)
    tail_stores = [i for i in stores if i > max(stage_waits)]
    assert epilogue != 2 or (len(tail_stores), len(tail)) == ((4, 4) if kv else (2, 3))
    assert any("ex2.approx" in line for line in lines) == (epilogue == 1)   # SiLU only in its epilogue
    weights_per_thread = config.groups * (group_size // 8) * config.block_n * 8 // (32 * config.num_warps)
    if config.half:   # four LOP3s and four packed FMAs of x a word of 8 weights
        assert sum("lop3.b32" in line and "0x44004400" in line for line in lines) == weights_per_thread // 2
        assert sum("fma.rn.f16x2" in line for line in lines) == 3 * weights_per_thread // 4
    else:
        assert sum("lop3.b32" in line and ("0x41800000" in line or "0x3F800000" in line) for line in lines) \
            == weights_per_thread


def _shared_memory_of_variants(variants):
    return [_compile_tma_gemv_for_sm90(*variant)[2] for variant in variants]


def test_tma_gemv_shared_memory_and_what_it_reserves():
    """`shared_bytes` is the compiled kernel's shared memory less under 2 KB of the compiler's scratch (zeros read
    or not, normed or not), the reserved buffer adds its whole size, and with `reserved_bytes` on an H100 (228 KB
    an SM, 1 KB more a CTA) the shipped tiles' programs fit `per_sm` to an SM, and an SM holding that many has no
    room for a program of another (each shipped tile, normed or not)."""
    import multiprocessing

    import triton
    from minivllm.kernels.int4_gemv_tma import CTA_RESERVED_BYTES, reserved_bytes, shared_bytes
    tiles = _shipped_tiles()
    K = 1024
    variants, estimates = [], []
    for config, zero_dtype, norm in itertools.product(tiles[:2] + TMA_TILES[:2], (torch.bfloat16, None),
                                                      (False, True)):
        variants.append((config, 128, torch.bfloat16, zero_dtype, 1 if config.block_n % 16 == 0 else 0, norm,
                         norm, False))
        x_steps = triton.next_power_of_2(triton.cdiv(K, config.groups * 16 * 8)) if norm else 0
        estimates.append(shared_bytes(config, 16, 2, 0 if zero_dtype is None else 2, x_steps))
    variants.append(variants[0][:-1] + (False, 32768))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        compiled = pool.apply(_shared_memory_of_variants, (variants,))
    for estimate, actual in zip(estimates, compiled):
        assert estimate <= actual < estimate + 2048
    assert compiled[-1] == compiled[0] + 32768

    sm = 228 * 1024
    held = []   # the least a program holds: its buffers, no scratch, the reservation and the CTA's 1 KB
    for tile in tiles:
        for normed in (False, True):
            x_steps = triton.next_power_of_2(triton.cdiv(4096, tile.groups * 16 * 8)) if normed else 0
            used = shared_bytes(tile, 16, 2, 0, x_steps)   # symmetric zeros
            held.append((tile.per_sm, used + reserved_bytes(tile, used, sm) + CTA_RESERVED_BYTES))
            assert tile.per_sm * (held[-1][1] + 2048) <= sm   # with the most scratch
    for (per_sm, a), (_, b) in itertools.permutations(held, 2):
        assert per_sm * a + b > sm


def test_tma_gemv_layout_split_and_refusals():
    """Which tiles divide a group's word rows, and the candidates' gate."""
    from minivllm.kernels.int4_gemv_tma import layout_split
    assert layout_split(TmaGemvConfig(32, 8, 4, 8), 16) == (1, 4, 8, 8, 1)
    assert layout_split(TmaGemvConfig(64, 8, 2, 4, columns=8, rows=8), 16) == (2, 2, 8, 4, 1)
    assert layout_split(TmaGemvConfig(32, 8, 4, 8), 4) is None          # 4 threads a group of 32: 32 groups a stage
    assert layout_split(TmaGemvConfig(32, 4, 8, 8), 16) is None         # 8 warps over 4 groups
    assert layout_split(TmaGemvConfig(32, 8, 4, 8, rows=3), 16) is None
    assert int4_gemm.tma_gemv_tiles(1, 128, 4, torch.bfloat16, torch.device("cpu")) == []
    meta = torch.device("meta")
    assert int4_gemm.tma_gemv_tiles(2, 128, 4, torch.bfloat16, meta) == []
    assert int4_gemm.tma_gemv_tiles(1, 128, 4, torch.float32, meta) == []
    cuda = torch.device("cuda")
    assert all(layout_split(t, 16) for t in int4_gemm.tma_gemv_tiles(1, 128, 4, torch.bfloat16, cuda))
    assert int4_gemm.tma_gemv_tiles(1, 32, 4, torch.float16, cuda)
    qweight, scales, zeros = random_weights(256, 64, 128, 4, torch.bfloat16)
    with pytest.raises(ValueError, match="sm_90"):
        weight_only_gemm(torch.ones(2, 256, dtype=torch.bfloat16, device=DEVICE), qweight, scales, zeros, 128, 4,
                         config=TmaGemvConfig(32, 4, 8, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", TMA_TILES)
@pytest.mark.parametrize("K,I,group_size,dtype,fractional", [
    (640, 200, 128, torch.bfloat16, False),     # a K tail; the halves' last tile past I
    (1056, 264, 32, torch.float16, True),       # GGUF's fractional fp32 zero points
    (4096, 1024, 128, torch.bfloat16, False)])  # several tiles a program
def test_tma_gemv_gated_matches_reference(config, K, I, group_size, dtype, fractional):
    """The Gluon GEMV with silu(gate) * up in its epilogue against the reference GEMM and activation, on
    gate_up's layout (W = [gate | up]), twice: the same bits; where the halves are not 16-byte aligned it is
    not offered."""
    from minivllm.kernels.activation import silu_and_mul_reference
    from minivllm.kernels.int4_gemm import weight_only_gemv_silu_and_mul
    from minivllm.kernels.int4_gemv_tma import layout_split
    qweight, scales, zeros = random_weights(K, 2 * I, group_size, 4, dtype, seed=K + I)
    if fractional:
        zeros = (torch.rand(zeros.shape, generator=torch.Generator().manual_seed(7)) * 40 - 12).to(DEVICE)
    x = (torch.randn(1, K, generator=torch.Generator().manual_seed(5)) * 2).to(dtype).to(DEVICE)
    if layout_split(config, group_size // 8) is None:
        with pytest.raises(ValueError, match="does not divide"):
            weight_only_gemv_silu_and_mul(x, qweight, scales, zeros, group_size, 4, config=config)
        return
    reference = silu_and_mul_reference(weight_only_gemm_reference(x.float(), qweight, scales, zeros, group_size, 4))
    ours = weight_only_gemv_silu_and_mul(x, qweight, scales, zeros, group_size, 4, config=config)
    assert ours.dtype == dtype and ours.shape == (1, I)
    torch.testing.assert_close(ours.float(), reference, rtol=3e-3, atol=3e-3 * reference.abs().max().item())
    assert torch.equal(weight_only_gemv_silu_and_mul(x, qweight, scales, zeros, group_size, 4, config=config), ours)
    odd = [t[:, :2 * I - 8] for t in (qweight, scales, zeros)]   # halves of I - 4 columns: not 16-byte aligned
    assert weight_only_gemv_silu_and_mul(x, *odd, group_size, 4, config=config) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", TMA_TILES)
@pytest.mark.parametrize("K,head_dim,heads,rotated,group_size,position", [
    (640, 128, 6, 4, 128, 37),        # a K tail; v's heads stored as they are
    (1056, 64, 9, 6, 32, 1000)])      # SmolLM2's head size
def test_tma_gemv_rotary_matches_reference(config, K, head_dim, heads, rotated, group_size, position):
    """The Gluon GEMV with the rotary embedding in its epilogue against the reference GEMM and
    `RotaryEmbedding.forward_reference`, on qkv_proj's layout; tiles that do not divide the group or a head's
    half are refused."""
    from minivllm.kernels.int4_gemm import weight_only_gemv_rotary
    from minivllm.kernels.int4_gemv_tma import Rotary, layout_split
    from minivllm.layers.rotary import RotaryEmbedding, default_inv_freq
    N = heads * head_dim
    qweight, scales, zeros = random_weights(K, N, group_size, 4, torch.bfloat16, seed=K + N)
    x = (torch.randn(1, K, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16).to(DEVICE)
    rope = RotaryEmbedding(head_dim, 2048, default_inv_freq(head_dim, 10000.0)).to(DEVICE)
    positions = torch.tensor([position], device=DEVICE)
    rotary = Rotary(positions, rope.cos_sin_cache, head_dim, rotated)
    if layout_split(config, group_size // 8) is None or (head_dim // 2) % (config.block_n // 2):
        with pytest.raises(ValueError, match="does not (divide|tile)"):
            weight_only_gemv_rotary(x, qweight, scales, zeros, group_size, 4, rotary, config=config)
        return
    plain = weight_only_gemm_reference(x.float(), qweight, scales, zeros, group_size, 4).view(heads, head_dim)
    q, k = rope.forward_reference(positions, plain[None, :rotated], plain[None, rotated:])
    reference = torch.cat([q[0, :rotated], plain[rotated:]]).view(1, N)
    ours = weight_only_gemv_rotary(x, qweight, scales, zeros, group_size, 4, rotary, config=config)
    assert ours.shape == (1, N)
    torch.testing.assert_close(ours.float(), reference, rtol=3e-3, atol=3e-3 * reference.abs().max().item())
    assert torch.equal(weight_only_gemv_rotary(x, qweight, scales, zeros, group_size, 4, rotary, config=config), ours)
    # with the KV write: the same y, and its k and v heads in the token's cache row (kernels/kv_write's layout),
    # the other rows untouched; slot -1 stores nothing
    from minivllm.kernels.int4_gemv_tma import KVWrite
    kv_heads = heads - rotated
    caches = torch.randn(2, 8, 16, kv_heads, head_dim, device=DEVICE).to(torch.bfloat16)
    for slot in (37, -1):
        k_cache, v_cache = caches.clone()
        kv = KVWrite(k_cache, v_cache, torch.tensor([slot], device=DEVICE), kv_heads)
        written = weight_only_gemv_rotary(x, qweight, scales, zeros, group_size, 4, rotary._replace(kv_cache=kv),
                                          config=config)
        assert torch.equal(written, ours)
        expected_k, expected_v = caches.clone()
        if slot >= 0:
            heads_out = ours.view(heads, head_dim)
            expected_k[slot // 16, slot % 16] = heads_out[rotated - kv_heads:rotated]
            expected_v[slot // 16, slot % 16] = heads_out[rotated:]
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", TMA_TILES)
@pytest.mark.parametrize("K,group_size,dtype", [(640, 128, torch.bfloat16), (4096, 128, torch.bfloat16),
                                                (1056, 32, torch.float16)])
def test_tma_gemv_shared_zero_point_gives_the_bits_of_reading_zeros(config, K, group_size, dtype):
    """Symmetric weights (every zero point 8): with zero_point=8 the kernel streams no zeros and gives the same
    bits as when it reads them, for the plain, the gated (normed, residual added: the same stream) and the rotary
    (the same KV rows written) epilogues; against the reference too. Unset, the zeros given are what it uses."""
    from minivllm.kernels.int4_gemv_tma import KVWrite, Rotary, RowNorm, int4_gemv_tma, layout_split
    from minivllm.layers.rotary import RotaryEmbedding, default_inv_freq
    if torch.cuda.get_device_capability() != (9, 0) or layout_split(config, group_size // 8) is None:
        pytest.skip("the Gluon GEMV is Hopper's; the tile must divide the group")
    N, head_dim = 768, 128
    qweight, scales, zeros = random_weights(K, N, group_size, 4, dtype, seed=K)
    eights = torch.full_like(zeros, 8)
    x = (torch.randn(1, K, generator=torch.Generator().manual_seed(5)) * 2).to(dtype).to(DEVICE)
    residual = (torch.randn(1, K, generator=torch.Generator().manual_seed(8)) * 2).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(K, generator=torch.Generator().manual_seed(6))).to(dtype).to(DEVICE)
    rope = RotaryEmbedding(head_dim, 2048, default_inv_freq(head_dim, 10000.0)).to(DEVICE)
    epilogues = ["plain", "gated"]
    if (head_dim // 2) % (config.block_n // 2) == 0 and dtype == torch.bfloat16:
        epilogues.append("rotary")
    for epilogue in epilogues:
        runs = []
        for given, zero_point in ((eights, None), (zeros, 8)):   # zeros read / not read (any values there)
            caches = torch.zeros(2, 8, 16, 1, head_dim, device=DEVICE, dtype=dtype)
            stream = torch.empty_like(x)
            options = {"gated": {"gated": True, "norm": RowNorm(weight, 1e-5, residual, stream)},
                       "rotary": {"rotary": Rotary(torch.tensor([37], device=DEVICE), rope.cos_sin_cache, head_dim,
                                                   5, KVWrite(caches[0], caches[1],
                                                              torch.tensor([21], device=DEVICE), 1))}}
            y = int4_gemv_tma(x, qweight, scales, given, group_size, config, zero_point=zero_point,
                              **options.get(epilogue, {}))
            runs.append((y, stream, caches))
        (y_read, stream_read, caches_read), (y_shared, stream_shared, caches_shared) = runs
        assert torch.equal(y_shared, y_read)
        if epilogue == "gated":
            assert torch.equal(stream_shared, stream_read)
        if epilogue == "rotary":
            assert torch.equal(caches_shared, caches_read) and caches_read.abs().sum() > 0
        if epilogue == "plain":
            reference = weight_only_gemm_reference(x.float(), qweight, scales, eights, group_size, 4)
            torch.testing.assert_close(y_shared.float(), reference, rtol=3e-3,
                                       atol=3e-3 * reference.abs().max().item())
            assert not torch.equal(int4_gemv_tma(x, qweight, scales, zeros, group_size, config), y_shared)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", TMA_TILES)
@pytest.mark.parametrize("K,N,group_size,dtype,fractional", [
    (640, 208, 128, torch.bfloat16, False),     # a K tail; N past the last tile
    (1056, 272, 32, torch.float16, True),       # GGUF's fractional fp32 zero points; fp16
    (4096, 1024, 128, torch.bfloat16, False)])  # the 8B hidden size: two K steps staged
def test_tma_gemv_norm_and_residual_match_reference(config, K, N, group_size, dtype, fractional):
    """The Gluon GEMV that norms x itself (RMSNorm(x) * weight staged in shared memory) against
    kernels/rmsnorm's references followed by the reference GEMM, plain and with the SiLU epilogue, without and
    with the residual added first (x + residual then written to the stream row, as the fused add + norm kernel
    writes it). The rows are large (an outlier of 3000: fp16 would overflow before the norm); each call twice:
    the same bits."""
    from minivllm.kernels.activation import silu_and_mul_reference
    from minivllm.kernels.int4_gemm import weight_only_gemv_silu_and_mul
    from minivllm.kernels.int4_gemv_tma import RowNorm, int4_gemv_tma, layout_split
    from minivllm.kernels.rmsnorm import fused_add_rms_norm_reference, rms_norm_reference
    qweight, scales, zeros = random_weights(K, N, group_size, 4, dtype, seed=K + N)
    if fractional:
        zeros = (torch.rand(zeros.shape, generator=torch.Generator().manual_seed(7)) * 40 - 12).to(DEVICE)
    x = (torch.randn(1, K, generator=torch.Generator().manual_seed(5)) * 40).to(dtype).to(DEVICE)
    x[0, 7] = 3000.0
    residual = (torch.randn(1, K, generator=torch.Generator().manual_seed(8)) * 40).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(K, generator=torch.Generator().manual_seed(6))).to(dtype).to(DEVICE)
    if layout_split(config, group_size // 8) is None:
        with pytest.raises(ValueError, match="does not divide"):
            int4_gemv_tma(x, qweight, scales, zeros, group_size, config, norm=RowNorm(weight, 1e-5))
        return

    def close(ours, reference):
        assert ours.dtype == dtype and ours.shape == reference.shape
        torch.testing.assert_close(ours.float(), reference, rtol=3e-3, atol=3e-3 * reference.abs().max().item())
    normed, stream = rms_norm_reference(x, weight, 1e-5), None
    for norm in (RowNorm(weight, 1e-5), RowNorm(weight, 1e-5, residual, torch.full_like(x, float("nan")))):
        if norm.residual is not None:
            normed, stream = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
        product = weight_only_gemm_reference(normed.float(), qweight, scales, zeros, group_size, 4)
        ours = int4_gemv_tma(x, qweight, scales, zeros, group_size, config, norm=norm)
        close(ours, product)
        assert torch.equal(int4_gemv_tma(x, qweight, scales, zeros, group_size, config, norm=norm), ours)
        if norm.residual is not None:
            assert torch.equal(norm.stream, stream)
        gated = weight_only_gemv_silu_and_mul(x, qweight, scales, zeros, group_size, 4, config=config, norm=norm)
        close(gated, silu_and_mul_reference(product))
    # what the kernel cannot take is not offered: a norm's weights in another dtype, a residual of another width
    assert weight_only_gemv_silu_and_mul(x, qweight, scales, zeros, group_size, 4,
                                         norm=RowNorm(weight.float(), 1e-5)) is None
    assert weight_only_gemv_silu_and_mul(x, qweight, scales, zeros, group_size, 4,
                                         norm=RowNorm(weight, 1e-5, residual[:, 2:], x.clone())) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", TMA_TILES)
@pytest.mark.parametrize("K,N,group_size,x_offset,dtype,fractional", [
    (640, 200, 128, 0, torch.bfloat16, False),       # a K tail past the last whole stage; N past the last tile
    (200, 8488, 64, 1, torch.bfloat16, False),      # K ragged inside a group; several tiles per program; x copied
    (4096, 4096, 128, 0, torch.float16, False),
    (1056, 264, 32, 0, torch.bfloat16, True)])      # GGUF's fractional fp32 zero points
def test_tma_gemv_matches_reference(config, K, N, group_size, x_offset, dtype, fractional):
    """The Gluon GEMV against the reference (tiles that do not divide the group are refused), twice: the same
    bits."""
    from minivllm.kernels.int4_gemv_tma import layout_split
    qweight, scales, zeros = random_weights(K, N, group_size, 4, dtype, seed=K + N)
    if fractional:
        zeros = (torch.rand(zeros.shape, generator=torch.Generator().manual_seed(7)) * 40 - 12).to(DEVICE)
    storage = (torch.randn(K + x_offset, generator=torch.Generator().manual_seed(5)) * 2).to(dtype).to(DEVICE)
    storage[x_offset + 7] = 300.0
    x = storage[x_offset:].view(1, K)
    if layout_split(config, group_size // 8) is None:
        with pytest.raises(ValueError, match="does not divide"):
            weight_only_gemm(x, qweight, scales, zeros, group_size, 4, config=config)
        return
    reference = weight_only_gemm_reference(x.float(), qweight, scales, zeros, group_size, 4)
    ours = weight_only_gemm(x, qweight, scales, zeros, group_size, 4, config=config)
    assert ours.dtype == dtype and ours.shape == (1, N)
    torch.testing.assert_close(ours.float(), reference, rtol=3e-3, atol=3e-3 * reference.abs().max().item())
    assert torch.equal(weight_only_gemm(x, qweight, scales, zeros, group_size, 4, config=config), ours)
