"""Prompt logprobs: the logprob of each prompt token given its prefix (plus the top-n), computed from the
hidden states of a prefill chunk's positions in the step that computes them.

Only sequences whose `SamplingParams.prompt_logprobs` is set get logits for their prompt positions, so a
batch without such requests pays one Python check per scheduled sequence and nothing on the device.
A chunk at positions [start, start + n) yields the entries of prompt positions start + 1 .. start + n
(the hidden state at q predicts the token at q + 1); the tokens they score are known on the host.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.core.interfaces import SchedulerOutput
from minivllm.core.sequence import SampleLogprobs
from minivllm.layers.sampler import compute_logprobs, gather_logprobs

# Rows of logits materialised at once: bounds the fp32 [rows, vocab] temporary of long prompts.
_ROWS_PER_PASS = 1024


@dataclass
class _Span:
    seq_index: int       # in SchedulerOutput.seqs
    first_position: int  # prompt position scored by the span's first row
    num_rows: int
    num_logprobs: int


@dataclass
class PromptLogprobs:
    """One step's prompt logprobs: rows of all spans concatenated; device tensors until `to_host`."""
    spans: list[_Span]
    token_ids: torch.Tensor  # [R, 1 + max n]: the prompt token, then the top-n
    logprobs: torch.Tensor   # [R, 1 + max n]
    ranks: torch.Tensor      # [R]

    def to_host(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Queue the copies (e.g. into pinned buffers); they are read by `entries()` after the step's sync."""
        self.token_ids, self.logprobs, self.ranks = copy(self.token_ids), copy(self.logprobs), copy(self.ranks)

    def entries(self) -> dict[int, tuple[int, list[SampleLogprobs]]]:
        ids, values, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        result, row = {}, 0
        for span in self.spans:
            width = 1 + span.num_logprobs
            result[span.seq_index] = (span.first_position, [
                SampleLogprobs(token_ids=ids[r][:width], logprobs=values[r][:width], rank=ranks[r])
                for r in range(row, row + span.num_rows)])
            row += span.num_rows
        return result


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            scheduler_output: SchedulerOutput, query_start_loc: list[int]
                            ) -> PromptLogprobs | None:
    """Prompt logprobs of this step's chunks, or None when no scheduled sequence asks for them."""
    spans: list[_Span] = []
    rows: list[np.ndarray] = []
    targets: list[int] = []
    for i, (seq, start, n) in enumerate(zip(scheduler_output.seqs, scheduler_output.num_computed_tokens,
                                            scheduler_output.num_scheduled_tokens)):
        num_logprobs = seq.sampling_params.prompt_logprobs
        # A sequence with outputs recomputes its prompt after preemption: its entries exist already.
        if num_logprobs is None or seq.num_output_tokens:
            continue
        end = min(start + n, seq.num_prompt_tokens - 1)  # the last prompt position scores no prompt token
        if end <= start:
            continue
        first_row = query_start_loc[i]
        rows.append(np.arange(first_row, first_row + end - start))
        targets.extend(seq.token_ids[start + 1:end + 1])
        spans.append(_Span(i, start + 1, end - start, num_logprobs))
    if not spans:
        return None
    max_logprobs = max(span.num_logprobs for span in spans)
    device = hidden.device
    row_ids = torch.from_numpy(np.concatenate(rows)).to(device, non_blocking=True)
    target_ids = torch.tensor(targets, dtype=torch.int64).to(device, non_blocking=True)
    parts = []
    for begin in range(0, len(targets), _ROWS_PER_PASS):
        index = row_ids[begin:begin + _ROWS_PER_PASS]
        logprobs = compute_logprobs(compute_logits(hidden[index]))
        parts.append(gather_logprobs(logprobs, max_logprobs, target_ids[begin:begin + _ROWS_PER_PASS]))
    ids, values, ranks = (torch.cat(tensors) for tensors in zip(*parts))
    return PromptLogprobs(spans, ids, values, ranks)
