"""The batched LoRA kernels (kernels/lora.py) against their plain-PyTorch references: under TRITON_INTERPRET=1 on
the CPU (conftest sets it), and in bf16 on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.kernels.lora import (DECODE_ROWS, block_m_for, block_table, lora_expand, lora_expand_reference,
                                   lora_shrink, lora_shrink_reference, max_blocks, shrink_split_k, sort_rows)


def _mapping(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, block table) as LoRABatch builds them for this many rows, padded as its buffers are."""
    rows, counts = sort_rows(token_slots.cpu().numpy(), num_slots)
    sorted_ids = torch.zeros(token_slots.numel() + 3, dtype=torch.int32)
    sorted_ids[:rows.size] = torch.from_numpy(rows.astype(np.int32))
    block_m = block_m_for(token_slots.numel())
    table = block_table(counts, block_m, max_blocks(token_slots.numel(), num_slots, block_m) + 2)
    return sorted_ids.to(token_slots.device), torch.from_numpy(table).to(token_slots.device)


def _case(num_tokens, k, widths, rank, num_slots, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    x = rand(num_tokens, k)
    lora_a = rand(num_slots, k, len(widths) * rank) / k ** 0.5
    lora_b = rand(num_slots, rank, sum(widths))
    y = rand(num_tokens, sum(widths))
    # Every slot, base rows (-1) among them, runs of one slot split by others.
    token_slots = torch.randint(-1, num_slots, (num_tokens,), generator=generator).to(device, torch.int32)
    return x, lora_a, lora_b, y, token_slots


@pytest.mark.parametrize("num_tokens,k,widths,rank,num_slots", [
    (1, 64, (48,), 8, 2),              # one decode row
    (5, 100, (40, 24, 24), 16, 3),     # packed qkv, odd K, rank under the 16-wide tile
    (37, 72, (30, 30), 4, 4),          # a prompt chunk, gate_up, widths not a tile multiple
    (70, 48, (200,), 16, 1),           # more rows than one block, one adapter
    (DECODE_ROWS + 45, 40, (24, 40), 8, 3),   # a long chunk: row blocks of 64, runs of several blocks
])
def test_shrink_and_expand_match_reference(num_tokens, k, widths, rank, num_slots):
    x, lora_a, lora_b, y, token_slots = _case(num_tokens, k, widths, rank, num_slots, torch.float32, "cpu")
    sorted_ids, table = _mapping(token_slots, num_slots)
    partials = lora_shrink(x, lora_a, sorted_ids, table)
    shrunk = lora_shrink_reference(x, lora_a, token_slots)
    used = token_slots >= 0
    torch.testing.assert_close(partials.sum(0)[used], shrunk[used], atol=1e-5, rtol=1e-5)
    expected = lora_expand_reference(y.clone(), shrunk, lora_b, token_slots, widths)
    ours = lora_expand(y.clone(), partials, lora_b, sorted_ids, table, widths)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours[~used], y[~used]), "rows without an adapter must be left untouched"


@pytest.mark.parametrize("num_tokens", [3, DECODE_ROWS + 9])
def test_expand_reads_each_rows_own_slot_from_a_stacked_gemm(num_tokens):
    """The dense layers' form: every slot's x · A sits beside y in one GEMM output, y a view of it."""
    widths, rank, num_slots = (24, 8, 8), 4, 3
    x, lora_a, lora_b, y, token_slots = _case(num_tokens, 40, widths, rank, num_slots, torch.float32, "cpu", seed=1)
    n, sr = sum(widths), len(widths) * rank
    out = torch.cat([y, torch.einsum("tk,skr->tsr", x, lora_a).reshape(num_tokens, num_slots * sr)], dim=1)
    sorted_ids, table = _mapping(token_slots, num_slots)
    ours = lora_expand(out[:, :n], out[:, n:], lora_b, sorted_ids, table, widths)
    expected = lora_expand_reference(y.clone(), lora_shrink_reference(x, lora_a, token_slots), lora_b, token_slots,
                                     widths)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert ours.data_ptr() == out.data_ptr(), "y is updated in place, in the GEMM's output"


def test_no_adapter_rows_leave_the_output_unchanged():
    x, lora_a, lora_b, y, _ = _case(6, 32, (16,), 8, 2, torch.float32, "cpu")
    token_slots = torch.full((6,), -1, dtype=torch.int32)
    sorted_ids, table = _mapping(token_slots, 2)
    out = lora_expand(y.clone(), lora_shrink(x, lora_a, sorted_ids, table), lora_b, sorted_ids, table, (16,))
    assert torch.equal(out, y)


def test_split_k_spreads_decode_rows_and_not_long_chunks():
    assert shrink_split_k(1, 4096) == 16 and shrink_split_k(64, 14336) == 16
    assert shrink_split_k(512, 4096) == 4 and shrink_split_k(1, 64) == 1


@pytest.mark.parametrize("block_m", [16, 64])
def test_block_table_covers_each_adapter_row_once_within_its_slot(block_m):
    generator = np.random.default_rng(0)
    cases = [(n, slots, generator.integers(-1, slots, n)) for n, slots in [(1, 8), (64, 8), (300, 3), (1000, 5)]]
    for num_tokens, num_slots, token_slots in cases:
        token_slots[: num_tokens // 3] = num_slots - 1   # one long run next to short ones
    # the most blocks T rows can need: every slot but one holds a single row, the last one the rest
    cases += [(n, 8, np.concatenate([np.arange(7), np.full(n - 7, 7)])) for n in (block_m + 7, 2 * block_m + 8)]
    cases.append((1, 8, np.array([5])))
    for num_tokens, num_slots, token_slots in cases:
        rows, counts = sort_rows(token_slots, num_slots)
        num_blocks = max_blocks(num_tokens, num_slots, block_m)
        table = block_table(counts, block_m, num_blocks)
        assert table.shape == (3, num_blocks)
        seen = []
        for slot, first, end in table.T:
            if slot < 0:
                continue
            assert first < end
            block_rows = rows[first:min(end, first + block_m)]
            assert (token_slots[block_rows] == slot).all()
            seen.extend(block_rows.tolist())
        assert sorted(seen) == np.flatnonzero(token_slots >= 0).tolist()
        used = table[0] >= 0
        assert used.sum() == (-(-counts // block_m)).sum(), "only a slot's last block may be partly filled"
        assert (np.diff(used.astype(int)) <= 0).all(), "used blocks come first"


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
def test_kernels_match_reference_in_bf16_on_gpu(num_tokens):
    x, lora_a, lora_b, y, token_slots = _case(num_tokens, 4096, (4096, 1024, 1024), 16, 8, torch.bfloat16, "cuda")
    sorted_ids, table = _mapping(token_slots, 8)
    partials = lora_shrink(x, lora_a, sorted_ids, table)
    shrunk = lora_shrink_reference(x, lora_a, token_slots)
    expected = lora_expand_reference(y.clone(), shrunk, lora_b, token_slots, (4096, 1024, 1024))
    ours = lora_expand(y.clone(), partials, lora_b, sorted_ids, table, (4096, 1024, 1024))
    torch.testing.assert_close(ours.float(), expected.float(), atol=0.1, rtol=0.02)
