"""The batched LoRA kernels (kernels/lora.py) against their plain-PyTorch references: under TRITON_INTERPRET=1 on
the CPU (conftest sets it), and in bf16 on a GPU."""
from __future__ import annotations

import pytest
import torch

from minivllm.kernels.lora import (lora_expand, lora_expand_reference, lora_shrink, lora_shrink_reference,
                                   shrink_split_k)


def _mapping(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, slot_starts) as LoRABatch builds them, padded as its static buffers are."""
    rows = torch.nonzero(token_slots >= 0).flatten()
    order = torch.sort(token_slots[rows], stable=True).indices
    sorted_ids = torch.zeros(token_slots.numel() + 3, dtype=torch.int32)
    sorted_ids[:rows.numel()] = rows[order].to(torch.int32)
    counts = torch.bincount(token_slots[rows].long(), minlength=num_slots)
    starts = torch.zeros(num_slots + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(counts, 0)
    return sorted_ids.to(token_slots.device), starts.to(token_slots.device)


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
])
def test_shrink_and_expand_match_reference(num_tokens, k, widths, rank, num_slots):
    x, lora_a, lora_b, y, token_slots = _case(num_tokens, k, widths, rank, num_slots, torch.float32, "cpu")
    sorted_ids, starts = _mapping(token_slots, num_slots)
    partials = lora_shrink(x, lora_a, sorted_ids, starts)
    shrunk = lora_shrink_reference(x, lora_a, token_slots)
    used = token_slots >= 0
    torch.testing.assert_close(partials.sum(0)[used], shrunk[used], atol=1e-5, rtol=1e-5)
    expected = lora_expand_reference(y.clone(), shrunk, lora_b, token_slots, widths)
    ours = lora_expand(y.clone(), partials, lora_b, sorted_ids, starts, widths)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours[~used], y[~used]), "rows without an adapter must be left untouched"


def test_no_adapter_rows_leave_the_output_unchanged():
    x, lora_a, lora_b, y, _ = _case(6, 32, (16,), 8, 2, torch.float32, "cpu")
    token_slots = torch.full((6,), -1, dtype=torch.int32)
    sorted_ids, starts = _mapping(token_slots, 2)
    out = lora_expand(y.clone(), lora_shrink(x, lora_a, sorted_ids, starts), lora_b, sorted_ids, starts, (16,))
    assert torch.equal(out, y)


def test_split_k_spreads_decode_rows_and_not_long_chunks():
    assert shrink_split_k(1, 4096) == 16 and shrink_split_k(512, 4096) == 4 and shrink_split_k(1, 64) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
def test_kernels_match_reference_in_bf16_on_gpu(num_tokens):
    x, lora_a, lora_b, y, token_slots = _case(num_tokens, 4096, (4096, 1024, 1024), 16, 8, torch.bfloat16, "cuda")
    sorted_ids, starts = _mapping(token_slots, 8)
    partials = lora_shrink(x, lora_a, sorted_ids, starts)
    shrunk = lora_shrink_reference(x, lora_a, token_slots)
    expected = lora_expand_reference(y.clone(), shrunk, lora_b, token_slots, (4096, 1024, 1024))
    ours = lora_expand(y.clone(), partials, lora_b, sorted_ids, starts, (4096, 1024, 1024))
    torch.testing.assert_close(ours.float(), expected.float(), atol=0.1, rtol=0.02)
