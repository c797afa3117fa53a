"""The dense GEMV against F.linear (under TRITON_INTERPRET=1 without CUDA): every tile, one row and a few, odd row
and column counts that no tile divides, with and without bias; the norm folded in front of it (against the norm
kernel's reference, residual stream and normed row included); the dispatch rules that send only a few 16-bit rows to
it and norms only to single rows of small grids; and decoder layers whose norms run in their GEMVs against the plain
layers."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import minivllm.kernels  # noqa: E402,F401  (installs the interpreter fix before any launch)
from minivllm.kernels import dense_gemv  # noqa: E402
from minivllm.kernels.rmsnorm import RowNorm, fused_add_rms_norm_reference, rms_norm_reference  # noqa: E402

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


@pytest.mark.parametrize("tile", dense_gemv.GEMV_STREAM_TILES + ((3, 1, 2, "stream"),))
@pytest.mark.parametrize("n", [37, 203])
def test_streaming_gemv_matches_linear(tile, n):
    """The streaming tiles (each program several tiles of rows, the next in flight while one is summed) equal
    F.linear's row, with a bias; they take no row wider than STREAM_MAX_K."""
    g = torch.Generator().manual_seed(n)
    k = 1100
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, torch.bfloat16)
    x = torch.randn(1, k, generator=g).to(DEVICE, torch.bfloat16)
    bias = torch.randn(n, generator=g).to(DEVICE, torch.bfloat16)
    out = dense_gemv.gemv(x, weight, bias, tile)
    expected = F.linear(x.float(), weight.float(), bias.float())
    assert out.shape == (1, n)
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    wide = torch.zeros(n, dense_gemv.STREAM_MAX_K + 1, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        dense_gemv.gemv(torch.zeros(1, wide.shape[1], dtype=torch.bfloat16, device=DEVICE), wide, None, tile)


@pytest.mark.parametrize("tile, num_rows, with_bias", [
    (tile, num_rows, with_bias) for num_rows, with_bias in [(2, False), (3, True), (8, True), (13, False), (48, True)]
    for tile in dense_gemv.rows_tiles(num_rows)])
def test_gemv_of_a_few_rows_matches_linear(tile, num_rows, with_bias):
    """Each row of a few (3: padded to 4 inside the per-row kernel; 13 and 48: to 16 and 64 on the tensor cores) equals
    F.linear's, with a leading batch dimension and rows that are a strided view (a slice of wider rows, as a fused
    projection's output is)."""
    g = torch.Generator().manual_seed(num_rows)
    n, k = 37, 1100
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, torch.bfloat16)
    wide = torch.randn(num_rows, k + 30, generator=g).to(DEVICE, torch.bfloat16)
    x = wide[:, 10:10 + k].unsqueeze(0)
    bias = torch.randn(n, generator=g).to(DEVICE, torch.bfloat16) if with_bias else None
    out = dense_gemv.gemv(x, weight, bias, tile)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.shape == (1, num_rows, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="one row"):
        dense_gemv.gemv(x, weight, bias, tile, norm=RowNorm(torch.ones(k, dtype=torch.bfloat16), 1e-5))
    if tile not in dense_gemv.rows_tiles(64):   # the per-row tiles take 8 rows at most, the widest MMA ones 16 or 32
        with pytest.raises(ValueError, match="does not take 64 rows"):
            dense_gemv.gemv(torch.zeros(64, k, dtype=torch.bfloat16, device=DEVICE), weight, bias, tile)


def _assert_rounded_alike(ours, expected):
    """Equal on the GPU. The interpreter's casts to bf16 truncate instead of rounding to nearest, so there a value
    may sit a step or two away (the normed row is rounded twice, from a stream value already a step away)."""
    if ours.is_cuda:
        assert torch.equal(ours, expected)
    else:
        torch.testing.assert_close(ours.float(), expected.float(), rtol=2 ** -5, atol=0)


def _row(k, seed, scale=1.0):
    return (torch.randn(1, k, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("tile", [dense_gemv.GEMV_TILES[0], dense_gemv.GEMV_TILES[-1], *dense_gemv.GEMV_STREAM_TILES])
@pytest.mark.parametrize("with_residual, write_normed, with_bias", [
    (True, True, False), (True, False, True), (False, True, False)])
def test_gemv_with_norm_matches_the_norm_then_the_linear(tile, with_residual, write_normed, with_bias):
    """RMSNorm(x + residual) @ W^T in one kernel: the output against the norm's reference and F.linear, and the
    residual stream and normed row it writes bit for bit against the norm's (each program writes a share)."""
    n, k = 37, 1100
    weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) / k ** 0.5).to(DEVICE, torch.bfloat16)
    x, residual = _row(k, 1, 4.0), _row(k, 2, 4.0) if with_residual else None
    norm_weight = (1.0 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(3))).to(DEVICE, torch.bfloat16)
    bias = _row(n, 4)[0] if with_bias else None
    stream = torch.empty_like(x) if with_residual else None
    normed = torch.empty_like(x) if write_normed else None
    out = dense_gemv.gemv(x, weight, bias, tile, norm=RowNorm(norm_weight, 1e-5, residual, stream, normed))
    if with_residual:
        expected_normed, expected_stream = fused_add_rms_norm_reference(x, residual, norm_weight, 1e-5)
        _assert_rounded_alike(stream, expected_stream)
    else:
        expected_normed = rms_norm_reference(x, norm_weight, 1e-5)
    if write_normed:
        _assert_rounded_alike(normed, expected_normed)
    expected = F.linear(expected_normed.float(), weight.float(), None if bias is None else bias.float())
    # the GEMV multiplies the unrounded normed row: bf16 steps apart from the rounded one's products
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.long
@pytest.mark.parametrize("arch", ["llama3", "qwen3-moe"])
def test_decoder_layers_with_norms_in_their_gemvs_match_the_plain_layers(arch, tmp_path, monkeypatch):
    """Decoding one token at a time, a model whose norms (and residual adds) run in the GEMVs after them (qkv_proj,
    gate_up_proj, an MoE block's router, which hands the normed row to the experts: the tiny model's grids are all
    small) gives the logits of the plain layers and of transformers. The GEMV is let take the CPU's fp32 rows."""
    from tests.conftest import PagedRun, assert_logits_close, make_tiny_hf_checkpoint
    from minivllm.models.loader import load_model, resolve_model
    reference = make_tiny_hf_checkpoint(tmp_path, arch)
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    tokens = [3, 5, 7, 11, 13]
    plain = PagedRun(model, 1, 8)
    expected = torch.cat([plain.step([[t]])[0] for t in tokens])
    calls = []

    def counted(x, weight):
        calls.append(tuple(weight.shape))
        return x.numel() == x.shape[-1] and weight.dtype == x.dtype and weight.stride(1) == 1
    monkeypatch.setattr(dense_gemv, "supports", counted)
    layers = model.model.layers
    assert all(layer.norms_in_gemvs(torch.zeros(1, 64)) == (True, True) for layer in layers)
    assert layers[0].norms_in_gemvs(torch.zeros(2, 64)) == (False, False)
    fused = PagedRun(model, 1, 8)
    ours = torch.cat([fused.step([[t]])[0] for t in tokens])
    assert calls   # the GEMV ran
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert_logits_close(ours, reference(torch.tensor([tokens])).logits[0])


def test_only_a_few_16bit_rows_take_the_gemv_and_one_row_its_norm():
    weight = torch.zeros(8, 16, dtype=torch.bfloat16)
    one_row = torch.zeros(1, 16, dtype=torch.bfloat16)
    on_cuda = DEVICE.type == "cuda"
    assert dense_gemv.supports(one_row.to(DEVICE), weight.to(DEVICE)) == on_cuda   # the GPU only
    if on_cuda:
        def rows(m):
            return torch.zeros(m, 16, dtype=torch.bfloat16, device=DEVICE)
        assert dense_gemv.supports(rows(dense_gemv.MAX_ROWS), weight.to(DEVICE))
        assert not dense_gemv.supports(rows(dense_gemv.MAX_ROWS + 1), weight.to(DEVICE))
        assert dense_gemv.folds_norm(rows(1), weight.to(DEVICE))
        assert not dense_gemv.folds_norm(rows(2), weight.to(DEVICE))
        assert not dense_gemv.supports(one_row.float().to(DEVICE), weight.float().to(DEVICE))
        assert not dense_gemv.supports(one_row.to(DEVICE), weight.to(DEVICE).t().contiguous().t())


def test_more_than_one_row_only_up_to_the_row_and_weight_bounds():
    small = torch.empty(8, 16, dtype=torch.bfloat16)
    large = torch.empty(dense_gemv.ROWS_MAX_WEIGHT_BYTES // 32 + 1, 16, dtype=torch.bfloat16)   # one row past it
    assert dense_gemv.takes_rows(1, small) and dense_gemv.takes_rows(1, large)
    assert dense_gemv.takes_rows(2, small) and dense_gemv.takes_rows(dense_gemv.MAX_ROWS, small)
    assert not dense_gemv.takes_rows(dense_gemv.MAX_ROWS + 1, small) and not dense_gemv.takes_rows(0, small)
    assert not dense_gemv.takes_rows(2, large)
    assert dense_gemv.takes_rows(2, large[:-1])


@pytest.mark.gpu
def test_linear_is_timed_per_shape_and_matches_cublas_in_a_graph():
    """On the GPU `linear` times cuBLAS against the GEMV tiles at a shape's and row count's first call and keeps the
    choice; its output, one row, six and forty, replayed from a CUDA graph, equals F.linear's to bf16 rounding at
    attention, router and odd shapes."""
    from minivllm.kernels import tuning
    g = torch.Generator().manual_seed(1)
    for n, k, with_bias in ((5120, 2048, False), (128, 2048, False), (1600, 1600, True), (37, 1100, True)):
        weight = (torch.randn(n, k, generator=g) / k ** 0.5).to("cuda", torch.bfloat16)
        bias = torch.randn(n, generator=g).to("cuda", torch.bfloat16) if with_bias else None
        for num_rows, padded in ((1, 1), (6, 8), (40, 64)):
            tiles = dense_gemv.GEMV_TILES + dense_gemv.GEMV_STREAM_TILES if num_rows == 1 else dense_gemv.rows_tiles(padded)
            x = torch.randn(num_rows, k, generator=g).to("cuda", torch.bfloat16)
            dense_gemv.linear(x, weight, bias)   # times the candidates (outside any capture)
            key = ("dense_gemv", torch.bfloat16, (n, k), with_bias, *((("rows", padded),) if num_rows > 1 else ()))
            assert key in tuning._chosen and tuning._chosen[key] in (None, *tiles)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = dense_gemv.linear(x, weight, bias)
            x.copy_(torch.randn(num_rows, k, generator=g).to("cuda", torch.bfloat16))
            graph.replay()
            expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_norm_folds_into_small_grids_and_streaming_tiles_and_matches_in_a_graph():
    """On the GPU the norm folds into a router-sized GEMV, and into a qkv-sized one only where the streaming tiles take
    its rows (the only tiles offered there); with it folded in, every tile, replayed from a CUDA graph, gives the norm
    kernel's residual stream and normed row exactly and the norm kernel then the projection's output to bf16
    rounding."""
    from minivllm.kernels import tuning
    from minivllm.kernels.rmsnorm import fused_add_rms_norm
    wide = dense_gemv.STREAM_MAX_K * 2
    assert not dense_gemv.folds_norm(torch.zeros(1, wide, dtype=torch.bfloat16, device="cuda"),
                                     torch.zeros(5120, wide, dtype=torch.bfloat16, device="cuda"))
    g = torch.Generator().manual_seed(2)
    # Qwen3-30B-A3B's and Mixtral-8x7B's routers, Qwen3-30B-A3B's qkv_proj
    for n, k in ((128, 2048), (8, 4096), (5120, 2048)):
        weight = (torch.randn(n, k, generator=g) / k ** 0.5).to("cuda", torch.bfloat16)
        norm_weight = (1.0 + 0.1 * torch.randn(k, generator=g)).to("cuda", torch.bfloat16)
        x, residual = (torch.randn(1, k, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        assert dense_gemv.folds_norm(x, weight)
        stream, normed = torch.empty_like(x), torch.empty_like(x)
        norm = RowNorm(norm_weight, 1e-6, residual, stream, normed)
        dense_gemv.linear(x, weight, None, norm=norm)   # times the tiles (outside any capture)
        tiles = dense_gemv.GEMV_STREAM_TILES if n > dense_gemv.NORM_FOLD_MAX_ROWS else (
            *dense_gemv.GEMV_TILES, *dense_gemv.GEMV_STREAM_TILES)
        assert tuning._chosen[("dense_gemv", torch.bfloat16, (n, k), False, "norm")] in tiles
        for tile in tiles:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = dense_gemv.gemv(x, weight, None, tile, norm=norm)
            x.copy_(torch.randn(1, k, generator=g).to("cuda", torch.bfloat16))
            graph.replay()
            expected_normed, expected_stream = fused_add_rms_norm(x, residual, norm_weight, 1e-6)
            assert torch.equal(stream, expected_stream) and torch.equal(normed, expected_normed)
            expected = F.linear(expected_normed, weight).float()
            torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
