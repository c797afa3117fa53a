"""The few-row dense GEMM (kernels/dense_gemm.py) against F.linear: odd shapes under TRITON_INTERPRET=1
without CUDA (K not a multiple of the tile, N not a multiple of the tile, split-K with a short last slice);
on the GPU every candidate tile at SmolLM2's and Llama-3-8B's layer shapes, and the linear layer's dispatch."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from minivllm.kernels import dense_gemm  # noqa: E402  (applies the interpreter fix first)
from minivllm.kernels.dense_gemm import DenseTile, candidates, dense_gemm_reference, dense_gemm_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("M,N,K,config", [
    (3, 40, 72, DenseTile(32, 64, 2, 2, 1)),     # ragged N and K, one slice
    (5, 72, 200, DenseTile(32, 64, 2, 2, 2)),    # two slices of 128 and 72
    (16, 24, 392, DenseTile(64, 128, 4, 2, 3)),  # a full row tile, a tile wider than N
])
def test_dense_gemm_matches_reference(M, N, K, config):
    generator = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=generator).to(DEVICE)
    w = torch.randn(N, K, generator=generator).to(DEVICE)
    ours = dense_gemm_triton(x, w, config)
    reference = dense_gemm_reference(x.double(), w.double()).float()
    assert ours.shape == (M, N) and ours.dtype == x.dtype
    # fp32 tiles may multiply in tf32 on a GPU; the interpreter multiplies in full precision.
    tolerance = 1e-4 if DEVICE.type == "cpu" else 2e-3
    torch.testing.assert_close(ours, reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,K", [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576),
                                 (6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("M", [3, 8, 16])
def test_dense_gemm_cuda_candidates(M, N, K):
    generator = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(M, K, device="cuda", generator=generator, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=generator, dtype=torch.bfloat16) / K ** 0.5
    reference = dense_gemm_reference(x.float(), w.float())
    for config in candidates(M, N, K, x.device):
        ours = dense_gemm.dense_gemm(x, w) if config is None else dense_gemm_triton(x, w, config)
        torch.testing.assert_close(ours.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linear_layer_routes_few_rows_through_the_dense_gemm(monkeypatch):
    from minivllm.layers.linear import ReplicatedLinear
    layer = ReplicatedLinear(576, 960).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.data.normal_()
    calls = []
    monkeypatch.setattr(dense_gemm, "dense_gemm", lambda x, w: calls.append(x.shape[0]) or torch.nn.functional.linear(x, w))
    for rows in (1, 2, 3, 8, 16, 17):
        layer(torch.randn(rows, 576, device="cuda", dtype=torch.bfloat16))
    assert calls == [3, 8, 16]
