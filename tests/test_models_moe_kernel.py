"""The fused MoE Triton kernels against their PyTorch reference (under TRITON_INTERPRET=1 without CUDA):
the grouped path and the few-token GEMV path, odd token counts and shapes, every expert hit, some experts
empty, every token on the same experts, and the sort/pad bookkeeping on its own."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import minivllm.kernels  # noqa: E402,F401  (installs the interpreter fix before any launch)
from minivllm.kernels.fused_moe import (  # noqa: E402
    FEW_ROW_TILES, GEMV_TILES, GROUPED_TILES, MID_ROW_TILES, UNSORTED_TILES, _grouped_experts, fused_experts,
    fused_experts_reference)
from minivllm.kernels import moe_grouped_mm  # noqa: E402
from minivllm.kernels.moe_sort import moe_align_block_size, sort_slots  # noqa: E402
from minivllm.kernels.quant_rows import quantize_rows_reference, round_trip_rows  # noqa: E402
from minivllm.layers.fused_moe import select_experts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _weights(num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5).to(DEVICE, dtype)
    return w13, w2


def _routing(num_tokens, num_experts, top_k, hidden, dtype, allowed=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(DEVICE, dtype)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if allowed is not None:   # experts outside `allowed` are never chosen: they stay empty
        mask = torch.full((num_experts,), float("-inf"))
        mask[list(allowed)] = 0.0
        logits = logits + mask
    weights, ids = select_experts(logits.to(DEVICE), top_k, renormalize=True)
    return x, weights, ids


@pytest.mark.parametrize("num_tokens, num_experts, top_k, allowed", [
    (1, 8, 2, None),            # decode: one token, most experts empty
    (37, 8, 2, None),           # odd count, every expert hit
    (19, 6, 3, {0, 2, 5}),      # experts 1, 3, 4 empty
    (70, 4, 1, None),           # several tiles per expert
])
def test_fused_experts_match_reference(num_tokens, num_experts, top_k, allowed):
    hidden, inter, dtype = 48, 40, torch.float32   # not multiples of the tile sizes
    w13, w2 = _weights(num_experts, hidden, inter, dtype)
    x, weights, ids = _routing(num_tokens, num_experts, top_k, hidden, dtype, allowed)
    if allowed is None and num_tokens > 1:
        assert ids.unique().numel() == num_experts
    ours = fused_experts(x, w13, w2, weights, ids)
    expected = fused_experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


# A GROUP_M tile computes its twin's tiles in another order (test_row_tile_groups_take_every_tile_once): not repeated.
TILES = [tile for tile in FEW_ROW_TILES + MID_ROW_TILES + GROUPED_TILES + UNSORTED_TILES if "GROUP_M" not in tile]
TMA_TILES = [tile for tile in TILES if tile.get("TMA")]


# A TMA tile runs as its pointer twin where it does not divide the shapes: only the dividing shapes below test it.
@pytest.mark.parametrize("tile", [tile for tile in TILES if not tile.get("TMA")] + [moe_grouped_mm.GROUPED_MM])
def test_every_timed_grouped_tile_matches_the_reference(tile):
    """The tiles the tuner chooses from, for decode batches and prefill (torch's grouped GEMM among them): odd
    shapes, one expert empty, one over-full. In bf16 on a GPU: some tiles need more shared memory than an H200 has
    in fp32 (the tuner drops a tile that fails to launch)."""
    hidden, inter = 48, 40
    dtype, tol = (torch.float32, 1e-4) if DEVICE.type == "cpu" else (torch.bfloat16, 2e-2)
    w13, w2 = _weights(4, hidden, inter, dtype)
    x, weights, ids = _routing(150, 4, 2, hidden, dtype, allowed={0, 1, 3})
    ids[:90, 0] = 3   # expert 3 takes over half the slots
    ids[:90, 1] = torch.where(ids[:90, 1] == 3, 0, ids[:90, 1])
    ours = _grouped_experts(x, w13, w2, weights, ids, None, None, tile)
    torch.testing.assert_close(ours.float(), fused_experts_reference(x, w13, w2, weights, ids).float(), rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("tile", [FEW_ROW_TILES[2], MID_ROW_TILES[0], GROUPED_TILES[2], *TMA_TILES])
def test_grouped_tiles_that_divide_the_shapes_match_the_reference(tile):
    """Where a tile divides both GEMMs' N and K only the padding rows are masked: 256 columns and 256 of K for
    gate/up, 256 and 128 for down; one expert empty, one over-full. In bf16 on a GPU, as above."""
    hidden, inter = 256, 128
    dtype, tol = (torch.float32, 1e-4) if DEVICE.type == "cpu" else (torch.bfloat16, 2e-2)
    w13, w2 = _weights(4, hidden, inter, dtype)
    x, weights, ids = _routing(24, 4, 2, hidden, dtype, allowed={0, 1, 3})
    ids[:16, 0] = 3
    ids[:16, 1] = torch.where(ids[:16, 1] == 3, 0, ids[:16, 1])
    ours = _grouped_experts(x, w13, w2, weights, ids, None, None, tile)
    torch.testing.assert_close(ours.float(), fused_experts_reference(x, w13, w2, weights, ids).float(), rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("tile", [tile for tile in GROUPED_TILES if tile.get("GATED") and "GROUP_M" not in tile])
def test_gated_tiles_round_like_the_separate_activation_in_bf16(tile):
    """SiLU-and-mul in the gate/up GEMM's epilogue (each program streams BLOCK_N / 2 gate and as many up columns)
    rounds where the separate kernel does: the tile with and without it gives the same bf16 output, bit for bit, on
    shapes that divide the tile (through TMA where the tile asks) and on shapes that do not; one expert over-full."""
    for hidden, inter in ((256, 256), (48, 40)):
        w13, w2 = _weights(4, hidden, inter, torch.bfloat16)
        x, weights, ids = _routing(150, 4, 2, hidden, torch.bfloat16, allowed={0, 1, 3})
        ids[:90, 0] = 3
        ids[:90, 1] = torch.where(ids[:90, 1] == 3, 0, ids[:90, 1])
        plain = {key: value for key, value in tile.items() if key != "GATED"}
        separate = _grouped_experts(x, w13, w2, weights, ids, None, None, plain)
        assert torch.equal(_grouped_experts(x, w13, w2, weights, ids, None, None, tile), separate)


def test_row_tile_groups_take_every_tile_once():
    """Programs ordered in groups of GROUP_M row tiles (the last group shorter) compute each (row tile, column block)
    once: the same output, bit for bit, as in launch order, on several groups of row tiles and column blocks."""
    hidden, inter = 96, 80
    w13, w2 = _weights(4, hidden, inter, torch.float32)
    x, weights, ids = _routing(150, 4, 2, hidden, torch.float32, allowed={0, 1, 3})
    ids[:90, 0] = 3
    ids[:90, 1] = torch.where(ids[:90, 1] == 3, 0, ids[:90, 1])
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4)
    in_order = _grouped_experts(x, w13, w2, weights, ids, None, None, tile)
    for group in (3, 64):   # several groups, the last one shorter; one group longer than the grid
        assert torch.equal(_grouped_experts(x, w13, w2, weights, ids, None, None, dict(tile, GROUP_M=group)), in_order)
    torch.testing.assert_close(in_order, fused_experts_reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_half_tail_tiles_compute_a_groups_short_last_tile_at_half_height():
    """HALF_TAIL computes a tile whose second half is padding as BLOCK_M / 2 rows: the full tile's output (bit for bit
    on the GPU; the interpreter's matmul rounds by its M) on groups whose last tile holds fewer than half its rows
    (experts 0 and 3), more (expert 1) and exactly half (expert 2), gate/up gated and plain."""
    hidden, inter = 64, 48
    w13, w2 = _weights(4, hidden, inter, torch.float32)
    counts = (40, 60, 48, 3)   # 32-row tiles: last tiles of 8, 28, 16 and 3 rows
    ids = torch.cat([torch.full((count,), expert) for expert, count in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))].view(-1, 1).to(DEVICE)
    x = torch.randn(ids.shape[0], hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for gated in (False, True):
        tile = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, GATED=gated)
        full = _grouped_experts(x, w13, w2, weights, ids, None, None, tile)
        half = _grouped_experts(x, w13, w2, weights, ids, None, None, dict(tile, HALF_TAIL=True))
        if DEVICE.type == "cuda":
            assert torch.equal(half, full)
        torch.testing.assert_close(half, full, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(full, fused_experts_reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tile", UNSORTED_TILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unsorted_tiles_compute_the_sorted_tiles_rows(tile, dtype):
    """Without the sort each expert's programs take its slots in slot order, BLOCK_M at a time: the tiles the sorted,
    padded list gives, so the output is bit for bit the sorted path's (one expert over-full, over several tiles,
    one empty)."""
    hidden, inter = 256, 128
    w13, w2 = _weights(4, hidden, inter, dtype)
    x, weights, ids = _routing(60, 4, 2, hidden, dtype, allowed={0, 1, 3})
    ids[:50, 0] = 3
    ids[:50, 1] = torch.where(ids[:50, 1] == 3, 0, ids[:50, 1])
    sorted_tile = {key: value for key, value in tile.items() if key != "UNSORTED"}
    unsorted = _grouped_experts(x, w13, w2, weights, ids, None, None, tile)
    assert torch.equal(unsorted, _grouped_experts(x, w13, w2, weights, ids, None, None, sorted_tile))


@pytest.mark.parametrize("tile", ["grouped", GEMV_TILES[0], GEMV_TILES[-1]])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, allowed", [
    (1, 8, 2, None),            # one token: two experts hit, six empty
    (3, 6, 3, {1, 4, 5}),       # every token on the same three experts (over-full), three empty
    (5, 8, 2, {0, 7}),          # two experts take every slot
])
def test_both_paths_match_the_reference_on_few_tokens(num_tokens, num_experts, top_k, allowed, tile):
    hidden, inter = 72, 40   # not multiples of any tile
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32)
    x, weights, ids = _routing(num_tokens, num_experts, top_k, hidden, torch.float32, allowed)
    ours = fused_experts(x, w13, w2, weights, ids, tile=tile)
    torch.testing.assert_close(ours, fused_experts_reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_few_token_path_rounds_like_the_grouped_path_in_bf16():
    """bf16: the GEMV path rounds the gate/up products and the activation where the grouped path does, so
    the two agree to a bf16 ulp or so, and both to the fp32 computation within bf16 rounding."""
    w13, w2 = _weights(8, 64, 48, torch.bfloat16)
    x, weights, ids = _routing(4, 8, 2, 64, torch.bfloat16)
    gemv = fused_experts(x, w13, w2, weights, ids, tile=GEMV_TILES[1])
    grouped = fused_experts(x, w13, w2, weights, ids, tile="grouped")
    assert gemv.dtype == torch.bfloat16
    torch.testing.assert_close(gemv.float(), grouped.float(), rtol=1e-2, atol=1e-2)
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(gemv.float(), expected, rtol=2e-2, atol=2e-2)


def _codes(weight, dtype):
    """8-bit codes [E, rows, cols] and row scales [E, rows] of stacked expert weights."""
    codes, scale = quantize_rows_reference(weight.reshape(-1, weight.shape[-1]), dtype)
    return codes.view(weight.shape), scale.view(weight.shape[:2])


def _w8a8_reference(x, w13, w2, weights, ids, code_dtype):
    """The grouped path's W8A8 arithmetic on dequantized values: each GEMM's input rows rounded to the experts'
    8-bit format and back first (fp32 inputs here, so the round trip adds no other rounding)."""
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token_idx, k_idx = torch.where(ids == expert)
        gate_up = round_trip_rows(x[token_idx], code_dtype) @ w13[expert].T
        inter = gate_up.shape[1] // 2
        activated = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = round_trip_rows(activated, code_dtype) @ w2[expert].T
        out.index_add_(0, token_idx, y * weights[token_idx, k_idx, None])
    return out


@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.int8])
def test_8bit_experts_w8a8_on_the_grouped_path_and_weight_only_on_the_few_token_path(code_dtype):
    """Grouped GEMMs: 8-bit activations times 8-bit weights, scaled per row and column (W8A8). Few-token
    GEMVs: the codes widened against the activations as they are (weight-only). Each against its reference."""
    w13, w2 = _weights(6, 72, 40, torch.float32)
    (w13q, s13), (w2q, s2) = _codes(w13, code_dtype), _codes(w2, code_dtype)
    w13d, w2d = w13q.float() * s13[..., None], w2q.float() * s2[..., None]
    x, weights, ids = _routing(5, 6, 2, 72, torch.float32, {0, 2, 3})
    grouped = fused_experts(x, w13q, w2q, weights, ids, tile="grouped", w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(grouped, _w8a8_reference(x, w13d, w2d, weights, ids, code_dtype), rtol=1e-4,
                               atol=1e-4)
    gemv = fused_experts(x, w13q, w2q, weights, ids, tile=GEMV_TILES[1], w13_scale=s13, w2_scale=s2)
    expected = fused_experts_reference(x, w13q, w2q, weights, ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(gemv, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(expected, fused_experts_reference(x, w13d, w2d, weights, ids), rtol=0, atol=0)
    # activation rounding is the only difference between the two paths
    assert 0 < (grouped - gemv).abs().max() < 0.05 * gemv.abs().max()
    with pytest.raises(ValueError, match="row scales"):
        fused_experts(x, w13q, w2q, weights, ids, w13_scale=s13)


@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.int8])
def test_8bit_experts_take_the_same_tiles_without_the_sort(code_dtype):
    """W8A8 through an unsorted tile: the sorted tile's output bit for bit (an expert over-full, one empty)."""
    w13, w2 = _weights(6, 72, 40, torch.float32)
    (w13q, s13), (w2q, s2) = _codes(w13, code_dtype), _codes(w2, code_dtype)
    x, weights, ids = _routing(40, 6, 2, 72, torch.float32, {0, 2, 3, 5})
    ids[:30, 0] = 5
    ids[:30, 1] = torch.where(ids[:30, 1] == 5, 0, ids[:30, 1])
    tile = UNSORTED_TILES[0]
    sorted_tile = {key: value for key, value in tile.items() if key != "UNSORTED"}
    unsorted = _grouped_experts(x, w13q, w2q, weights, ids, s13, s2, tile)
    assert torch.equal(unsorted, _grouped_experts(x, w13q, w2q, weights, ids, s13, s2, sorted_tile))


def test_fused_experts_bf16_rounds_like_a_linear_layer():
    """bf16 inputs, fp32 accumulation: within bf16 rounding of the fp32 computation."""
    w13, w2 = _weights(4, 32, 24, torch.bfloat16)
    x, weights, ids = _routing(9, 4, 2, 32, torch.bfloat16)
    ours = fused_experts(x, w13, w2, weights, ids)
    assert ours.dtype == torch.bfloat16
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=2e-2)


def test_align_groups_slots_by_expert_in_whole_tiles():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 3]], device=DEVICE)   # expert 2 empty
    block_m = 4
    sorted_ids, expert_ids = moe_align_block_size(ids, num_experts=4, block_m=block_m)
    num_slots = ids.numel()
    flat = ids.flatten().tolist()
    seen = []
    for tile, expert in enumerate(expert_ids.tolist()):
        slots = [s for s in sorted_ids[tile * block_m:(tile + 1) * block_m].tolist() if s < num_slots]
        if expert < 0:
            assert not slots
            continue
        assert slots and all(flat[s] == expert for s in slots)
        seen.extend(slots)
    assert sorted(seen) == list(range(num_slots))       # every slot exactly once
    assert 2 not in expert_ids.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 513])
def test_fused_experts_bf16_realistic_shapes(num_tokens):
    """Qwen3-30B-A3B's expert shapes (128 experts, top 8, hidden 2048, 768 per expert) in bf16."""
    w13, w2 = _weights(128, 2048, 768, torch.bfloat16)
    x, weights, ids = _routing(num_tokens, 128, 8, 2048, torch.bfloat16)
    ours = fused_experts(x, w13, w2, weights, ids)
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(ours.float(), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tile", UNSORTED_TILES)
def test_unsorted_tiles_bf16_realistic_shapes(tile):
    """A 64-token decode step at Qwen3-30B-A3B's expert shapes (512 slots): without the sort, bit for bit the
    sorted path's output."""
    w13, w2 = _weights(128, 2048, 768, torch.bfloat16)
    x, weights, ids = _routing(64, 128, 8, 2048, torch.bfloat16)
    sorted_tile = {key: value for key, value in tile.items() if key != "UNSORTED"}
    unsorted = _grouped_experts(x, w13, w2, weights, ids, None, None, tile)
    assert torch.equal(unsorted, _grouped_experts(x, w13, w2, weights, ids, None, None, sorted_tile))


@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize", [
    (1, 128, 8, True),     # Qwen3-30B-A3B at decode
    (5, 8, 2, True),       # Mixtral
    (7, 60, 4, False),     # Qwen2-MoE: experts not a power of two, no rescaling
    (3, 6, 3, True),       # top_k not a power of two
    (0, 8, 2, True),
])
def test_routing_kernel_matches_select_experts(num_tokens, num_experts, top_k, renormalize):
    from minivllm.kernels.moe_routing import route
    # fp32 logits: bf16 ones tie, and the order of tied experts is not part of either contract
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    weights, ids = route(logits, top_k, renormalize)
    expected_weights, expected_ids = select_experts(logits, top_k, renormalize)
    assert ids.dtype == expected_ids.dtype and weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    if renormalize and num_tokens:
        torch.testing.assert_close(weights.sum(dim=1), torch.ones(num_tokens, device=DEVICE))


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m, allowed", [
    (1, 128, 8, 16, None),      # decode, Qwen3's routing
    (64, 128, 8, 16, None),     # several chunks of slots, most experts hit
    (37, 8, 2, 32, {1, 6}),     # over-full experts, six empty
    (9, 60, 4, 64, None),       # experts not a power of two
])
def test_align_kernel_equals_the_sort(num_tokens, num_experts, top_k, block_m, allowed):
    """The one-program bookkeeping writes exactly what the stable sort does: slot order within each group,
    sentinels in the padding, -1 for tiles past the last group."""
    from minivllm.kernels.moe_sort import align_one_program
    _, _, ids = _routing(num_tokens, num_experts, top_k, 8, torch.float32, allowed)
    sorted_ids, expert_ids = align_one_program(ids, num_experts, block_m)
    expected_sorted, expected_experts = moe_align_block_size(ids, num_experts, block_m)
    assert torch.equal(sorted_ids, expected_sorted)
    assert torch.equal(expert_ids, expected_experts)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m, allowed", [
    (200, 128, 8, 128, None),   # 1,600 slots in seven blocks of 256, Qwen3's routing
    (700, 8, 2, 16, {1, 6}),    # two blocks of 1,024, over-full experts, six empty
    (90, 60, 4, 64, None),      # experts not a power of two
    (300, 6, 3, 1, {0, 2, 5}),  # jagged groups
])
@pytest.mark.parametrize("one_hot_entries", [32768, 8192])   # the block widths of large and small shared memory
def test_counting_sort_groups_as_the_stable_sort(num_tokens, num_experts, top_k, block_m, allowed, one_hot_entries,
                                                 monkeypatch):
    """The multi-program counting sort puts the same slots in each group as the tensor operations do (in the order
    its atomics ran), sentinels in the rest of each padded group and the same tile experts, and `align_block_size`
    hands over to it above ALIGN_KERNEL_MAX_SLOTS."""
    from minivllm.kernels import moe_sort
    from minivllm.kernels.moe_sort import ALIGN_KERNEL_MAX_SLOTS, align_block_size
    monkeypatch.setattr(moe_sort, "_one_hot_entries", lambda device: one_hot_entries)
    _, _, ids = _routing(num_tokens, num_experts, top_k, 8, torch.float32, allowed)
    expected_sorted, expected_experts = moe_align_block_size(ids, num_experts, block_m)
    slots = sort_slots(ids, num_experts, block_m)
    counts = torch.bincount(ids.flatten().cpu(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    assert torch.equal(slots.ends.cpu().long(), ends)
    _assert_same_groups(slots.sorted_ids, expected_sorted, ends - padded, counts, num_tokens * top_k)
    if block_m > 1:
        assert torch.equal(slots.expert_ids, expected_experts)
    if block_m > 1 and num_tokens * top_k > ALIGN_KERNEL_MAX_SLOTS:
        sorted_ids, expert_ids = align_block_size(ids, num_experts, block_m)
        _assert_same_groups(sorted_ids, expected_sorted, ends - padded, counts, num_tokens * top_k)
        assert torch.equal(expert_ids, expected_experts)


def _assert_same_groups(sorted_ids, expected, starts, counts, num_slots):
    """Each group's first `count` rows hold the expected slots in some order; every other row the sentinel."""
    sorted_ids, expected = sorted_ids.cpu(), expected.cpu()
    assert sorted_ids.shape == expected.shape
    is_slot = torch.zeros(len(sorted_ids), dtype=torch.bool)
    for start, count in zip(starts.tolist(), counts.tolist()):
        group = slice(start, start + count)
        assert torch.equal(sorted_ids[group].sort().values, expected[group].sort().values)
        is_slot[group] = True
    assert bool((sorted_ids[~is_slot] == num_slots).all())


def test_counting_sort_gathers_each_slots_row_and_records_where_it_went():
    num_tokens, num_experts, top_k = 150, 6, 3
    x, _, ids = _routing(num_tokens, num_experts, top_k, 40, torch.float32, {0, 2, 3, 5})
    slots = sort_slots(ids, num_experts, hidden_states=x)
    order = slots.sorted_ids.long()
    flat = ids.flatten()
    assert torch.equal(order.sort().values.cpu(), torch.arange(num_tokens * top_k))   # a permutation of the slots
    assert bool((flat[order].diff() >= 0).all())   # grouped by expert, groups in expert order
    assert torch.equal(slots.rows, x[order // top_k])
    assert torch.equal(order[slots.position.long()].cpu(), torch.arange(num_tokens * top_k))
    with pytest.raises(ValueError, match="block_m must be 1"):
        sort_slots(ids, num_experts, 16, hidden_states=x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_weights_and_sums_each_tokens_rows(dtype):
    """fp32: exactly the reference under the interpreter, within fp32 rounding on a GPU (whose compiled kernel fuses
    each multiply-add); bf16: within a unit in the last place (the interpreter truncates where the GPU rounds to
    nearest)."""
    num_tokens, top_k, n = 11, 3, 40
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(num_tokens * top_k, n, generator=g).to(DEVICE, dtype)
    position = torch.randperm(num_tokens * top_k, generator=g).to(DEVICE, torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=g).to(DEVICE)
    ours = moe_grouped_mm.combine(rows, position, weights, top_k)
    expected = moe_grouped_mm.combine_reference(rows, position, weights, top_k)
    if dtype == torch.float32 and DEVICE.type == "cpu":
        assert torch.equal(ours, expected)
    elif dtype == torch.float32:
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.float(), expected.float(), rtol=1.6e-2, atol=1e-2)
    by_hand = (rows.float()[position.long()] * weights.reshape(-1, 1)).view(num_tokens, top_k, n).sum(1)
    torch.testing.assert_close(ours.float(), by_hand, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_sums_weighted_rows_in_slot_order(dtype):
    """The Triton grouped path's top-k sum: rows in slot order, weighted by the down GEMM already."""
    num_tokens, top_k, n = 9, 8, 72
    rows = torch.randn(num_tokens * top_k, n, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    ours = moe_grouped_mm.combine(rows, None, None, top_k)
    expected = moe_grouped_mm.combine_reference(rows, None, None, top_k)
    if dtype == torch.float32:   # the same sum in another order
        torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(ours.float(), rows.float().view(num_tokens, top_k, n).sum(1), rtol=1.6e-2, atol=2e-2)


def test_grouped_mm_path_takes_only_operands_it_can_run():
    """Torch's grouped GEMM needs rows of whole 16-byte units and experts in the model's dtype."""
    w13, _ = _weights(4, 48, 40, torch.float32)
    x = torch.zeros(3, 48, device=DEVICE)
    assert moe_grouped_mm.supported(x, w13, None) == (DEVICE.type == "cpu")   # fp32 runs only on the CPU
    odd, _ = _weights(4, 50, 40, torch.float32)
    assert not moe_grouped_mm.supported(torch.zeros(3, 50, device=DEVICE), odd, None)   # 200-byte rows
    assert not moe_grouped_mm.supported(x, w13, torch.ones(4, 80, device=DEVICE))     # 8-bit experts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_path_bf16_realistic_shapes():
    """Qwen3-30B-A3B's expert shapes at a prefill chunk, through torch's grouped GEMM."""
    w13, w2 = _weights(128, 2048, 768, torch.bfloat16)
    x, weights, ids = _routing(1100, 128, 8, 2048, torch.bfloat16)
    assert moe_grouped_mm.supported(x, w13, None)
    ours = _grouped_experts(x, w13, w2, weights, ids, None, None, moe_grouped_mm.GROUPED_MM)
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(ours.float(), expected, rtol=3e-2, atol=3e-2)


def test_grouped_tile_reuses_the_tuners_choice(monkeypatch):
    """Once a bucket's tile is chosen, every later call takes it without building the candidate list again."""
    from minivllm.kernels import fused_moe, tuning
    w13, w2 = _weights(4, 48, 40, torch.float32)
    x = torch.randn(300, 48).to(DEVICE)
    key = ("moe_grouped", x.dtype, w13.dtype, 1024, 4, 80, 48)   # 300 tokens x top 2: the 1,024-slot bucket
    monkeypatch.setitem(tuning._chosen, key, GROUPED_TILES[3])

    def never(*args):
        raise AssertionError("candidates built for a chosen bucket")
    monkeypatch.setattr(moe_grouped_mm, "supported", never)
    assert fused_moe._grouped_tile(x, w13, w2, 2, None, None) == GROUPED_TILES[3]
    monkeypatch.delitem(tuning._chosen, key)
    with pytest.raises(AssertionError, match="candidates built"):
        fused_moe._grouped_tile(x, w13, w2, 2, None, None)
