"""Rebase a step launched behind a verify step onto that step's actual acceptance, on the device.

A step chained behind a verify step still in flight was prepared as if every draft were accepted: each such
sequence's first input is the verify step's last row and its positions follow the last draft. When the
sequence accepted a < k drafts, its new token (the bonus) sits in row a and at a position k - a earlier. This
kernel reads the verify step's rows, finds a exactly as greedy verification does (drafts accepted while each
equals the row before it; the rows hold the targets, or -1 past a device verification's first mismatch), and
moves the chained step's part back: first input = the bonus, positions, slots (from the sequence's block table)
and context lengths shifted down by k - a. The chained step so computes the right continuation instead of
being thrown away, and the device never waits for the host to learn the count.

Per chained sequence (`entries` rows): (its index n in the verify step's draft layout, its first input row,
its number of input rows, its index in the chained step). The rows of one sequence are contiguous.
Reference: `rebase_chained_reference` (tensor ops); the kernel does the same in one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_accepted_and_bonus(prev_tokens, prev_row_index, prev_num_drafts, prev_drafts, n):
    k = prev_drafts.shape[1]
    target = prev_tokens[prev_row_index[n]]                                        # [R, K + 1]
    j = torch.arange(k + 1, device=prev_tokens.device)
    drafts = torch.nn.functional.pad(prev_drafts[n], (0, 1), value=-1)
    stops = (drafts != target) | (j >= prev_num_drafts[n].unsqueeze(1))
    accepted = torch.where(stops, j, k + 1).amin(dim=1)
    return accepted, target.gather(1, accepted.unsqueeze(1)).squeeze(1)


def rebase_chained_reference(prev_tokens: torch.Tensor, prev_row_index: torch.Tensor, prev_num_drafts: torch.Tensor,
                             prev_drafts: torch.Tensor, entries: torch.Tensor, input_ids: torch.Tensor,
                             positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                             block_tables: torch.Tensor, block_size: int,
                             context_lens: torch.Tensor | None = None) -> None:
    """In place. `prev_tokens` [S'] the verify step's sampled rows; `prev_row_index` [N', K + 1],
    `prev_num_drafts` [N'], `prev_drafts` [N', K] its draft layout (see inputs.SpecLayout); `entries` [R, 4]
    int64 as in the module docstring; `context_lens` [T] int32: each input row's context length (decode rows)."""
    n, first, count, seq = entries.unbind(1)
    accepted, bonus = _num_accepted_and_bonus(prev_tokens, prev_row_index, prev_num_drafts, prev_drafts, n)
    shift = prev_num_drafts[n] - accepted
    input_ids[first] = bonus
    width = int(count.max())
    offsets = torch.arange(width, device=entries.device)
    valid = offsets.unsqueeze(0) < count.unsqueeze(1)
    rows = (first.unsqueeze(1) + offsets)[valid]
    row_shift = shift.unsqueeze(1).expand(-1, width)[valid]
    new_positions = positions[rows] - row_shift
    positions[rows] = new_positions
    row_seq = seq.unsqueeze(1).expand(-1, width)[valid]
    blocks = block_tables[row_seq, new_positions // block_size].to(torch.int64)
    slot_mapping[rows] = blocks * block_size + new_positions % block_size
    seq_lens[seq] -= shift.to(seq_lens.dtype)
    if context_lens is not None:
        context_lens[rows] -= row_shift.to(context_lens.dtype)


@triton.jit
def _rebase_chained_kernel(prev_tokens_ptr, prev_row_index_ptr, prev_num_drafts_ptr, prev_drafts_ptr, entries_ptr,
                           input_ids_ptr, positions_ptr, slot_mapping_ptr, seq_lens_ptr, block_tables_ptr,
                           context_lens_ptr, stride_bt, block_size, K: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_T: tl.constexpr, HAS_CONTEXT_LENS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(entries_ptr + 4 * r)
    first = tl.load(entries_ptr + 4 * r + 1)
    count = tl.load(entries_ptr + 4 * r + 2)
    seq = tl.load(entries_ptr + 4 * r + 3)
    j = tl.arange(0, BLOCK_K)
    in_row = j < K + 1
    rows = tl.load(prev_row_index_ptr + n * (K + 1) + j, mask=in_row, other=0)
    target = tl.load(prev_tokens_ptr + rows, mask=in_row, other=-1)
    drafts = tl.load(prev_drafts_ptr + n * K + j, mask=j < K, other=-1)
    num_drafts = tl.load(prev_num_drafts_ptr + n)
    stops = (drafts != target) | (j >= num_drafts)
    accepted = tl.min(tl.where(stops, j, K + 1), axis=0)
    bonus = tl.sum(tl.where(j == accepted, target, 0), axis=0)
    shift = num_drafts - accepted
    tl.store(input_ids_ptr + first, bonus)
    t = tl.arange(0, BLOCK_T)
    mask = t < count
    position = tl.load(positions_ptr + first + t, mask=mask, other=0) - shift
    tl.store(positions_ptr + first + t, position, mask=mask)
    block = tl.load(block_tables_ptr + seq * stride_bt + position // block_size, mask=mask, other=0).to(tl.int64)
    tl.store(slot_mapping_ptr + first + t, block * block_size + position % block_size, mask=mask)
    tl.store(seq_lens_ptr + seq, tl.load(seq_lens_ptr + seq) - shift.to(tl.int32))
    if HAS_CONTEXT_LENS:
        lens = tl.load(context_lens_ptr + first + t, mask=mask, other=0)
        tl.store(context_lens_ptr + first + t, lens - shift.to(tl.int32), mask=mask)


def rebase_chained_triton(prev_tokens: torch.Tensor, prev_row_index: torch.Tensor, prev_num_drafts: torch.Tensor,
                          prev_drafts: torch.Tensor, entries: torch.Tensor, input_ids: torch.Tensor,
                          positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, block_size: int, context_lens: torch.Tensor | None = None,
                          max_rows: int = 1) -> None:
    """As `rebase_chained_reference`, in one launch; `max_rows`: the most input rows of any entry (host-known)."""
    k = prev_drafts.shape[1]
    _rebase_chained_kernel[(entries.shape[0],)](
        prev_tokens, prev_row_index, prev_num_drafts, prev_drafts, entries, input_ids, positions, slot_mapping,
        seq_lens, block_tables, positions if context_lens is None else context_lens, block_tables.stride(0),
        block_size, K=k, BLOCK_K=triton.next_power_of_2(k + 1), BLOCK_T=triton.next_power_of_2(max_rows),
        HAS_CONTEXT_LENS=context_lens is not None)


def rebase_chained(prev_tokens: torch.Tensor, prev_row_index: torch.Tensor, prev_num_drafts: torch.Tensor,
                   prev_drafts: torch.Tensor, entries: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                   context_lens: torch.Tensor | None, max_rows: int) -> None:
    """The kernel on CUDA (one launch: the host launches are what a batch-1 step waits on), else the reference."""
    if prev_tokens.is_cuda:
        rebase_chained_triton(prev_tokens, prev_row_index, prev_num_drafts, prev_drafts, entries, input_ids,
                              positions, slot_mapping, seq_lens, block_tables, block_size, context_lens, max_rows)
    else:
        rebase_chained_reference(prev_tokens, prev_row_index, prev_num_drafts, prev_drafts, entries, input_ids,
                                 positions, slot_mapping, seq_lens, block_tables, block_size, context_lens)
