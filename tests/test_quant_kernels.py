"""The Triton weight-only GEMM against its dequantize + matmul reference, on odd shapes (K not a
multiple of the tile, a ragged last group, N not a multiple of the tile), with and without split-K.
Under TRITON_INTERPRET=1 without CUDA; the `gpu` test uses 8B layer shapes in bf16."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from minivllm.kernels import int4_gemm  # noqa: E402,F401  (applies the interpreter fix first)
from minivllm.kernels.int4_gemm import weight_only_gemm, weight_only_gemm_reference  # noqa: E402
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 16, 64, 256])
@pytest.mark.parametrize("K,N", [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_weight_only_gemm_8b_shapes_bf16(M, K, N):
    qweight, scales, zeros = random_weights(K, N, 128, 4, torch.bfloat16)
    x = torch.randn(M, K, device=DEVICE).to(torch.bfloat16)
    ours = weight_only_gemm(x, qweight, scales, zeros, 128, 4)
    reference = weight_only_gemm_reference(x.float(), qweight, scales, zeros, 128, 4)
    torch.testing.assert_close(ours.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())
