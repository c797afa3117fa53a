"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run, and on an H100 a CUDA graph of
dependent PDL kernels (a quantized layer chain; an MoE decode chain whose down GEMV reads routing's output before
its wait) computes exactly what the same kernels compute launched one after another (`gpu`)."""
from __future__ import annotations

import pytest
import torch

from minivllm.kernels import pdl
from minivllm.kernels.activation import silu_and_mul
from minivllm.kernels.int4_gemm import GemvConfig, weight_only_gemm
from minivllm.kernels.quant_rows import FP8
from minivllm.kernels.rmsnorm import fused_add_rms_norm
from minivllm.kernels.w8a8_gemm import W8A8Tile, w8a8_triton


def test_off_on_cpu_and_under_the_interpreter(monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": 0}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.mode(torch.device("cuda", 0)) == 0   # decided before the device is queried
    monkeypatch.setenv("MINIVLLM_PDL", "yes")
    with pytest.raises(ValueError, match="MINIVLLM_PDL"):
        pdl.mode(torch.device("cpu"))


def test_prefetch_needs_16_byte_rows():
    assert pdl.rows_prefetchable(torch.zeros(8, 16, dtype=torch.int8))
    assert pdl.rows_prefetchable(torch.zeros(8, 4, dtype=torch.int32))
    assert not pdl.rows_prefetchable(torch.zeros(8, 8, dtype=torch.int8))     # an 8-byte row
    assert not pdl.rows_prefetchable(torch.zeros(8, 6, dtype=torch.int32))    # a 24-byte row
    assert not pdl.rows_prefetchable(torch.zeros(8, 32, dtype=torch.int8)[:, 1:17])   # base off by one byte


def _chain(x, residual, layers, w8a8_tile, gemv_tile):
    """Each kernel reads what the one before wrote: norm -> fp8 GEMM (split-K summed in the GEMM) ->
    SiLU-and-mul -> int4 GEMV (split-K, fused sum) -> norm ..., as a decode step chains its layers."""
    for norm_weight, w_codes, w_scale, qweight, scales, zeros in layers:
        rows, residual = fused_add_rms_norm(x, residual, norm_weight, 1e-5, quant_dtype=FP8)
        h = w8a8_triton(rows.codes, rows.scales, w_codes, w_scale, torch.bfloat16, w8a8_tile)
        h = silu_and_mul(h)
        x = weight_only_gemm(h, qweight, scales, zeros, 128, config=gemv_tile, split_k=4)
    return x, residual


def _layers(hidden, intermediate, count, device):
    generator = torch.Generator(device=device).manual_seed(0)
    layers = []
    for _ in range(count):
        w = torch.randn(2 * intermediate, hidden, device=device, generator=generator) / hidden ** 0.5
        w_scale = w.abs().amax(dim=1) / 448
        qweight = torch.randint(-2**31, 2**31 - 1, (intermediate // 8, hidden), device=device, dtype=torch.int32,
                                generator=generator)
        scales = torch.full((intermediate // 128, hidden), 2.0 / intermediate ** 0.5, device=device,
                            dtype=torch.bfloat16)
        zeros = torch.full_like(scales, 8.0)
        layers.append((torch.ones(hidden, device=device, dtype=torch.bfloat16),
                       (w / w_scale[:, None]).to(FP8), w_scale, qweight, scales, zeros))
    return layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("fused_sum", [False, True])
@pytest.mark.parametrize("setting", ["1"])
@pytest.mark.parametrize("half", [False, True])
def test_graph_of_pdl_kernels_matches_ordinary_launches(monkeypatch, fused_sum, setting, half):
    device = torch.device("cuda")
    hidden, intermediate = 1024, 2048
    layers = _layers(hidden, intermediate, 24, device)
    w8a8_tile = W8A8Tile(16, 64, 128, 4, 3, split_k=4, fused_sum=fused_sum)
    gemv_tile = GemvConfig(128, 128, 4, 3, fused_sum=fused_sum, half=half)
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    results = {mode: _graph_replays(monkeypatch, mode, lambda: torch.cat(
        _chain(x, residual, layers, w8a8_tile, gemv_tile), dim=1)) for mode in ("0", setting)}
    reference = results["0"][0]
    assert torch.isfinite(reference.float()).all()
    for replay in results["0"] + results[setting]:
        assert torch.equal(replay, reference)


def _graph_replays(monkeypatch, mode: str, chain) -> list[torch.Tensor]:
    """`chain()`'s output over 20 replays of a CUDA graph of it captured with MINIVLLM_PDL=mode (a race would show
    as a replay that differs)."""
    monkeypatch.setenv("MINIVLLM_PDL", mode)
    assert pdl.mode(torch.device("cuda")) == int(mode)
    chain()   # compiles the kernels and sizes the tickets
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    replays = []
    for _ in range(20):
        graph.replay()
        replays.append(out.clone())
    torch.cuda.synchronize()
    return replays


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper GPU")
def test_moe_decode_chain_of_pdl_kernels_matches_ordinary_launches(monkeypatch):
    """Router GEMV -> routing -> gate/up GEMV -> down GEMV, layer after layer at one token: the down GEMV reads the
    expert ids routing wrote two kernels before, ahead of its own wait. Each layer routes differently, so ids read
    too early (a previous layer's, in a buffer the graph's pool reuses) would pick other experts."""
    from minivllm.kernels import dense_gemv, fused_moe
    from minivllm.kernels.moe_routing import route
    device = torch.device("cuda")
    hidden, inter, num_experts = 1024, 384, 64   # 384 columns: the down GEMV's first 256 and a masked rest
    g = torch.Generator(device=device).manual_seed(0)
    layers = [((torch.randn(num_experts, hidden, device=device, generator=g) / hidden ** 0.5).bfloat16(),
               (torch.randn(num_experts, 2 * inter, hidden, device=device, generator=g) / hidden ** 0.5).bfloat16(),
               (torch.randn(num_experts, hidden, inter, device=device, generator=g) / inter ** 0.5).bfloat16())
              for _ in range(12)]
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)

    def chain():   # every layer on x (a chain through SwiGLU layers would overflow or vanish), one after another
        outs = []
        for router, w13, w2 in layers:
            weights, ids = route(dense_gemv.gemv(x, router, None, dense_gemv.GEMV_TILES[0]), 8, True)
            outs.append(fused_moe._few_token_experts(x, w13, w2, weights, ids, None, None, fused_moe.GEMV_TILES[0]))
        return torch.cat(outs)
    results = {mode: _graph_replays(monkeypatch, mode, chain) for mode in ("0", "1")}
    reference = results["0"][0]
    assert torch.isfinite(reference.float()).all() and reference.abs().max() > 0
    for replay in results["0"] + results["1"]:
        assert torch.equal(replay, reference)
