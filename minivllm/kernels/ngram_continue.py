"""Continue a batch-1 speculation chain on the device: finish reading a verify step still unread by the host,
then propose the next step's drafts by n-gram lookup and move that step onto the tokens accepted.

A step launched behind a verify step that the host has not read back is prepared as if every draft were
accepted: its first input row is at position p0 + 1 + K_prev (p0: the verify step's first row, K_prev: its
drafts). This kernel, in one launch before that step's forward pass:
- counts the verify step's accepted drafts a (each draft, `history[p0 + 1 + j]`, equal to the target of the row
  before it, `prev_tokens[j]`; a draft < 0 is no draft) and takes its new token, `prev_tokens[a]`;
- writes that token at `history[p0 + a + 1]` (the history then holds the sequence's `p0 + a + 2` tokens);
- looks up the latest earlier occurrence of the history's last n tokens, n from `max_n` down to `min_n` (the
  host's `NgramProposer` rule: a match ends before the last token, the longest n wins, then the latest match),
  and proposes up to `num_drafts` tokens that followed it (-1 for none), kept in `drafts` and after the new
  token in the history;
- writes the new token and the drafts into the step's input rows and moves the rows' positions, KV slots
  (from the block table) and context lengths back by K_prev - a.
A match ending at e with m matching trailing tokens scores min(m, max_n) * 2^32 + e: one max over every end
finds the longest match, then the latest, in a single pass over the history.

Reference: `ngram_continue_reference` (tensor ops); the kernel is one program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16          # a step's rows: its first token and up to 15 drafts
SEARCH_BLOCK = 1024    # history positions a program compares at once


def ngram_continue_reference(history: torch.Tensor, prev_tokens: torch.Tensor, p0: int, num_prev_drafts: int,
                             num_drafts: int, min_n: int, max_n: int, input_ids: torch.Tensor,
                             positions: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                             block_size: int, context_lens: torch.Tensor, drafts: torch.Tensor,
                             seq_len: torch.Tensor | None = None) -> None:
    """In place. `history` [L] int64 (every token up to p0 known, the verify step's drafts after it),
    `prev_tokens` [K_prev + 1] the verify step's sampled rows (targets; -1 past a device verification's first
    mismatch); `input_ids`, `positions`, `slot_mapping`, `context_lens` [1 + num_drafts] the step's rows;
    `block_table` [B] int32 the sequence's blocks; `drafts` [>= num_drafts] int64, written; `seq_len` [1]: the
    sequence's context length, where attention reads one (moved back too)."""
    device = history.device
    j = torch.arange(num_prev_drafts, device=device)
    proposed = history[p0 + 1 + j]
    matches = (proposed >= 0) & (proposed == prev_tokens[:num_prev_drafts])
    accepted = int(matches.int().cumprod(0).sum()) if num_prev_drafts else 0
    token = prev_tokens[accepted]
    length = p0 + accepted + 2
    history[length - 1] = token
    if num_drafts:
        ends = torch.arange(length - 1, device=device)                      # a match ends before the last token
        matched = torch.zeros(length - 1, dtype=torch.int64, device=device)
        running = torch.ones(length - 1, dtype=torch.bool, device=device)
        for t in range(max_n):
            at = ends - t
            equal = (at >= 0) & (history[at.clamp_min(0)] == history[length - 1 - t])
            running &= equal
            matched += running
        score = torch.where(matched >= min_n, matched * (1 << 32) + ends, -1)
        best = int(score.max()) if score.numel() else -1
        drafts[:num_drafts] = -1
        if best >= 0:
            start = (best & 0xFFFFFFFF) + 1
            count = min(num_drafts, length - start)
            drafts[:count] = history[start:start + count]
        history[length:length + num_drafts] = drafts[:num_drafts]
        input_ids[1:1 + num_drafts] = drafts[:num_drafts].clamp_min(0)
    input_ids[0] = token
    shift = num_prev_drafts - accepted
    rows = slice(0, 1 + num_drafts)
    moved = positions[rows] - shift
    positions[rows] = moved
    slot_mapping[rows] = block_table[moved // block_size].to(torch.int64) * block_size + moved % block_size
    context_lens[rows] -= shift
    if seq_len is not None:
        seq_len -= shift


@triton.jit
def _draft_at(history_ptr, j, start, best, num_drafts, last, token):
    """Draft j (-1 where there is none): the token at start + j, the new token when that is the last."""
    valid = (j >= 0) & (j < num_drafts) & (best >= 0) & (start + j <= last)
    source = tl.load(history_ptr + start + j, mask=valid & (start + j < last), other=-1)
    return tl.where(valid, tl.where(start + j == last, token, source), -1)


# Not specialised on its integers: each value class (1, a multiple of 16) would compile once more, mid-run.
@triton.jit(do_not_specialize=["p0", "num_prev_drafts", "num_drafts", "min_n", "block_size"])
def _ngram_continue_kernel(history_ptr, prev_tokens_ptr, p0, num_prev_drafts, num_drafts, min_n,
                           input_ids_ptr, positions_ptr, slot_mapping_ptr, block_table_ptr, block_size,
                           context_lens_ptr, drafts_ptr, seq_len_ptr, MAX_N: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK: tl.constexpr, HAS_SEQ_LEN: tl.constexpr):
    j = tl.arange(0, ROWS)
    in_prev = j < num_prev_drafts
    proposed = tl.load(history_ptr + p0 + 1 + j, mask=in_prev, other=-1)
    target = tl.load(prev_tokens_ptr + j, mask=j < num_prev_drafts + 1, other=-2)
    stops = (proposed < 0) | (proposed != target) | (j >= num_prev_drafts)
    accepted = tl.min(tl.where(stops, j, ROWS), axis=0)
    token = tl.sum(tl.where(j == accepted, target, 0), axis=0)
    length = p0 + accepted + 2
    last = length - 1
    # The lookup: every end e < last, its trailing match with the tail (the new token is in a register, not
    # yet stored: a store then a load of one address within a program would need a barrier).
    best = tl.full((), -1, tl.int64)
    if num_drafts > 0:
        for block_start in range(0, last, BLOCK):
            ends = block_start + tl.arange(0, BLOCK)
            valid = ends < last
            matched = tl.zeros((BLOCK,), tl.int64)
            running = valid
            for t in tl.static_range(MAX_N):
                if t == 0:
                    tail = token
                else:
                    tail = tl.load(history_ptr + last - t, mask=last - t >= 0, other=-3)
                at = ends - t
                value = tl.load(history_ptr + at, mask=running & (at >= 0), other=-4)
                running = running & (at >= 0) & (value == tail)
                matched += running.to(tl.int64)
            score = tl.where(valid & (matched >= min_n), matched * 4294967296 + ends, -1)
            best = tl.maximum(best, tl.max(score, axis=0))
    start = (best & 4294967295) + 1
    draft = _draft_at(history_ptr, j, start, best, num_drafts, last, token)
    tl.store(drafts_ptr + j, draft, mask=j < num_drafts)
    tl.store(history_ptr + last, token)
    tl.store(history_ptr + length + j, draft, mask=j < num_drafts)
    # The step's rows: its first token and the drafts, moved back by the drafts rejected before them.
    rows = j < num_drafts + 1
    before = tl.maximum(_draft_at(history_ptr, j - 1, start, best, num_drafts, last, token), 0)
    ids = tl.where(j == 0, token, before)
    tl.store(input_ids_ptr + j, ids, mask=rows)
    shift = num_prev_drafts - accepted
    position = tl.load(positions_ptr + j, mask=rows, other=0) - shift
    tl.store(positions_ptr + j, position, mask=rows)
    block = tl.load(block_table_ptr + position // block_size, mask=rows, other=0).to(tl.int64)
    tl.store(slot_mapping_ptr + j, block * block_size + position % block_size, mask=rows)
    lens = tl.load(context_lens_ptr + j, mask=rows, other=0)
    tl.store(context_lens_ptr + j, lens - shift.to(lens.dtype), mask=rows)
    if HAS_SEQ_LEN:
        total = tl.load(seq_len_ptr)
        tl.store(seq_len_ptr, total - shift.to(total.dtype))


def ngram_continue_triton(history: torch.Tensor, prev_tokens: torch.Tensor, p0: int, num_prev_drafts: int,
                          num_drafts: int, min_n: int, max_n: int, input_ids: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, block_table: torch.Tensor, block_size: int,
                          context_lens: torch.Tensor, drafts: torch.Tensor, seq_len: torch.Tensor | None = None) -> None:
    """As `ngram_continue_reference`, in one launch."""
    assert num_prev_drafts < MAX_ROWS and num_drafts < MAX_ROWS
    _ngram_continue_kernel[(1,)](history, prev_tokens, p0, num_prev_drafts, num_drafts, min_n, input_ids, positions,
                                 slot_mapping, block_table, block_size, context_lens, drafts,
                                 context_lens if seq_len is None else seq_len, MAX_N=max_n, ROWS=MAX_ROWS,
                                 BLOCK=SEARCH_BLOCK, HAS_SEQ_LEN=seq_len is not None)


def ngram_continue(*args, **kwargs) -> None:
    """The kernel on CUDA (one launch, where the host launches are what a batch-1 step waits on), else the
    reference."""
    history = args[0] if args else kwargs["history"]
    (ngram_continue_triton if history.is_cuda else ngram_continue_reference)(*args, **kwargs)
