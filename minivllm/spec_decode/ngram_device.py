"""The device half of n-gram speculation at batch 1: the running sequence's tokens on the device, so that the step
after a verify step can be launched before the host has read that step back (kernels/ngram_continue.py counts the
accepted drafts, proposes the next ones and moves the step onto them).

Owned by the model runner. The history holds, at their positions, every token the host knows (uploaded as they
become known, each once), the drafts of a verify step proposed on the host (uploaded with it) and what the kernel
writes: the tokens it learns from a verify step's rows and the drafts it proposes. Positions past the
sequence's length may hold drafts since rejected; lookups read only below it.
"""
from __future__ import annotations

import numpy as np
import torch

from minivllm.kernels.ngram_continue import MAX_ROWS, ngram_continue


class DeviceNgram:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, device: torch.device, stager) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.history = torch.zeros(4096, dtype=torch.int64, device=device)   # grown as sequences need
        self.drafts = torch.full((MAX_ROWS,), -1, dtype=torch.int64, device=device)   # the last step's proposals
        self.stager = stager   # its own: the copy must not wait for one queued behind a forward pass
        self.seq_id: int | None = None
        self.num_uploaded = 0   # the history's first tokens that the host has sent
        if device.type == "cuda":   # compiled now, not in the middle of the first request that speculates
            rows = torch.arange(2, dtype=torch.int64, device=device)
            self.continue_step(torch.zeros(2, dtype=torch.int64, device=device), 2, 1, 1, rows.clone(), rows + 2,
                               rows.clone(), torch.zeros(4, dtype=torch.int32, device=device), 16,
                               torch.ones(2, dtype=torch.int32, device=device))

    def upload(self, seq, start: int, drafts: list[int], stream=None) -> None:
        """Send the tokens of `seq` the host learnt since the last call and, for a verify step whose first row is
        at position `start`, its host-proposed `drafts` (after that row)."""
        if seq.seq_id != self.seq_id:
            self.seq_id, self.num_uploaded = seq.seq_id, 0
        needed = start + 3 * MAX_ROWS   # this step's rows, and the drafts a step behind it may write
        if self.history.numel() < needed:   # (in stream order: the copy follows every write to the old one)
            grown = torch.zeros(max(needed, 2 * self.history.numel()), dtype=torch.int64, device=self.history.device)
            grown[:self.history.numel()] = self.history
            self.history = grown
        tokens = seq.token_ids
        known = len(tokens)
        if known == self.num_uploaded and not drafts:
            return
        positions = list(range(self.num_uploaded, known)) + list(range(start + 1, start + 1 + len(drafts)))
        values = tokens[self.num_uploaded:] + list(drafts)
        self.num_uploaded = known
        (positions_d, values_d), = self.stager.transfer([(torch.int64, [np.asarray(positions, dtype=np.int64),
                                                                        np.asarray(values, dtype=np.int64)])], stream)
        self.history.index_copy_(0, positions_d, values_d)

    def continue_step(self, prev_tokens: torch.Tensor, start: int, num_prev_drafts: int, num_drafts: int,
                      input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      block_table: torch.Tensor, block_size: int, context_lens: torch.Tensor,
                      seq_len: torch.Tensor | None = None) -> torch.Tensor:
        """Finish the verify step before this one (`prev_tokens`: its sampled rows; `num_prev_drafts` drafts) and
        move this step (first row prepared at `start`, as if every draft were accepted; `num_drafts` rows of drafts
        after it) onto it. Returns this step's drafts [1, num_drafts] (-1: none), which its verification takes."""
        p0 = start - 1 - num_prev_drafts   # the verify step's first row
        ngram_continue(self.history, prev_tokens, p0, num_prev_drafts, num_drafts, self.min_n, self.max_n,
                       input_ids, positions, slot_mapping, block_table, block_size, context_lens, self.drafts,
                       seq_len)
        return self.drafts[:num_drafts].view(1, num_drafts)
