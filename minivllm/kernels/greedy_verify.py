"""Greedy verification of draft tokens in one kernel launch, with the plain-PyTorch reference.

Every row of a step has its target token (the argmax of its logits) in `sampled`. A speculating
sequence n owns the rows `row_index[n, 0..num_drafts[n]]` (later entries repeat its last row); it
accepts its drafts while each equals the target of the row before it, and keeps the target of the
first row that disagrees (or of its last row: the bonus token). Rows past that become -1.

At batch 1 on a small model each tensor op is a host launch costing about what its GPU work does: the
reference takes about ten of them, the kernel one (a verify step's sampling launch on SmolLM2 at
batch 1: 0.34 ms of host time against 0.04 ms for a plain step's argmax, H100 host).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def greedy_verify_reference(sampled: torch.Tensor, row_index: torch.Tensor, num_drafts: torch.Tensor,
                            draft_token_ids: torch.Tensor) -> torch.Tensor:
    """`sampled` [S] int64, `row_index` [N, K + 1], `num_drafts` [N], `draft_token_ids` [N, K] (-1 past
    num_drafts: -1 never equals a target, so it needs no mask). Returns a new [S] tensor; padding entries
    of `row_index` get their sequence's last position, so each row is written one value."""
    k = draft_token_ids.shape[1]
    target = sampled[row_index]                                                   # [N, K + 1]
    num_accepted = (draft_token_ids == target[:, :k]).cumprod(dim=1).sum(dim=1, keepdim=True)
    positions = torch.minimum(torch.arange(k + 1, device=sampled.device).unsqueeze(0), num_drafts.unsqueeze(1))
    values = torch.where(positions > num_accepted, -1, target)
    return sampled.scatter(0, row_index.flatten(), values.flatten())


@triton.jit
def _greedy_verify_kernel(sampled_ptr, row_index_ptr, num_drafts_ptr, drafts_ptr,
                          K: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    in_row = j < K + 1
    rows = tl.load(row_index_ptr + n * (K + 1) + j, mask=in_row, other=0)
    target = tl.load(sampled_ptr + rows, mask=in_row, other=-1)
    drafts = tl.load(drafts_ptr + n * K + j, mask=j < K, other=-1)
    num_drafts = tl.load(num_drafts_ptr + n)
    # Accepted drafts: those before the first position that is a mismatch or past the drafts.
    stops = (drafts != target) | (j >= num_drafts)
    num_accepted = tl.min(tl.where(stops, j, K + 1), axis=0)
    position = tl.minimum(j, num_drafts)
    tl.store(sampled_ptr + rows, tl.where(position > num_accepted, -1, target), mask=in_row)


def greedy_verify_triton(sampled: torch.Tensor, row_index: torch.Tensor, num_drafts: torch.Tensor,
                         draft_token_ids: torch.Tensor) -> torch.Tensor:
    """As `greedy_verify_reference`, in one launch, writing into `sampled` (each program reads its own
    sequence's rows before it writes them, and no two sequences share a row). Returns `sampled`."""
    num_seqs, k = draft_token_ids.shape
    _greedy_verify_kernel[(num_seqs,)](sampled, row_index.contiguous(), num_drafts.contiguous(),
                                       draft_token_ids.contiguous(), K=k, BLOCK=triton.next_power_of_2(k + 1))
    return sampled
