"""The one-row dense GEMV against F.linear (under TRITON_INTERPRET=1 without CUDA): every tile, odd row and column
counts that no tile divides, with and without bias; and the dispatch rule that sends only single 16-bit rows to it."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import minivllm.kernels  # noqa: E402,F401  (installs the interpreter fix before any launch)
from minivllm.kernels import dense_gemv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("tile", dense_gemv.GEMV_TILES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(tile, with_bias):
    g = torch.Generator().manual_seed(0)
    n, k = 37, 1100   # neither a multiple of any BLOCK_N nor of BLOCK_K: masked rows and columns
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, torch.bfloat16)
    x = torch.randn(1, k, generator=g).to(DEVICE, torch.bfloat16)
    bias = torch.randn(n, generator=g).to(DEVICE, torch.bfloat16) if with_bias else None
    out = dense_gemv.gemv(x, weight, bias, tile)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
    # fp32 sums, one rounding to bf16 at the end (the bias added before it)
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def test_only_single_16bit_rows_take_the_gemv():
    weight = torch.zeros(8, 16, dtype=torch.bfloat16)
    one_row = torch.zeros(1, 16, dtype=torch.bfloat16)
    on_cuda = DEVICE.type == "cuda"
    assert dense_gemv.supports(one_row.to(DEVICE), weight.to(DEVICE)) == on_cuda   # the GPU only
    if on_cuda:
        assert not dense_gemv.supports(torch.zeros(2, 16, dtype=torch.bfloat16, device=DEVICE), weight.to(DEVICE))
        assert not dense_gemv.supports(one_row.float().to(DEVICE), weight.float().to(DEVICE))
        assert not dense_gemv.supports(one_row.to(DEVICE), weight.to(DEVICE).t().contiguous().t())


@pytest.mark.gpu
def test_linear_is_timed_per_shape_and_matches_cublas_in_a_graph():
    """On the GPU `linear` times cuBLAS against the GEMV tiles at a shape's first call and keeps the choice; its
    output, replayed from a CUDA graph, equals F.linear's to bf16 rounding at attention, router and odd shapes."""
    from minivllm.kernels import tuning
    g = torch.Generator().manual_seed(1)
    for n, k, with_bias in ((5120, 2048, False), (128, 2048, False), (1600, 1600, True), (37, 1100, True)):
        weight = (torch.randn(n, k, generator=g) / k ** 0.5).to("cuda", torch.bfloat16)
        bias = torch.randn(n, generator=g).to("cuda", torch.bfloat16) if with_bias else None
        x = torch.randn(1, k, generator=g).to("cuda", torch.bfloat16)
        dense_gemv.linear(x, weight, bias)   # times the candidates (outside any capture)
        key = ("dense_gemv", torch.bfloat16, (n, k), with_bias)
        assert key in tuning._chosen and tuning._chosen[key] in (None, *dense_gemv.GEMV_TILES)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dense_gemv.linear(x, weight, bias)
        x.copy_(torch.randn(1, k, generator=g).to("cuda", torch.bfloat16))
        graph.replay()
        expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
