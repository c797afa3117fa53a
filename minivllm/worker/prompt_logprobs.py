"""Prompt logprobs: the logprob of each prompt token given its prefix (plus the top-n), computed from the
hidden states of a prefill chunk's positions in the step that computes them.

Only sequences whose `SamplingParams.prompt_logprobs` is set get logits for their prompt positions, so a
batch without such requests pays one Python check per scheduled sequence and nothing on the device.
A chunk at positions [start, start + n) yields the entries of prompt positions start + 1 .. start + n
(the hidden state at q predicts the token at q + 1); the tokens they score are known on the host.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
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


def prompt_logprob_rows(scheduler_output: SchedulerOutput, query_start_loc: list[int]
                        ) -> tuple[list[_Span], np.ndarray, list[int]] | None:
    """(spans, rows of the step's hidden states to score, the prompt tokens they score), or None when no
    scheduled sequence asks for prompt logprobs. Host work only."""
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
    return spans, np.concatenate(rows), targets


def compute_prompt_logits(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          rows: np.ndarray) -> Iterator[tuple[int, torch.Tensor | None]]:
    """(first row, logits) of `rows` of `hidden`, one pass of at most `_ROWS_PER_PASS` rows at a time. Under
    tensor parallelism every rank makes the same calls (each pass gathers the vocabulary shards to the
    driver); other ranks get None for each pass."""
    row_ids = torch.from_numpy(rows).to(hidden.device, non_blocking=True)
    for begin in range(0, len(rows), _ROWS_PER_PASS):
        yield begin, compute_logits(hidden[row_ids[begin:begin + _ROWS_PER_PASS]])


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            selected: tuple[list[_Span], np.ndarray, list[int]] | None) -> PromptLogprobs | None:
    """Prompt logprobs of this step's chunks (`selected`: `prompt_logprob_rows`' result), or None."""
    if selected is None:
        return None
    spans, rows, targets = selected
    max_logprobs = max(span.num_logprobs for span in spans)
    target_ids = torch.tensor(targets, dtype=torch.int64).to(hidden.device, non_blocking=True)
    parts = []
    for begin, logits in compute_prompt_logits(compute_logits, hidden, rows):
        logprobs = compute_logprobs(logits)
        parts.append(gather_logprobs(logprobs, max_logprobs, target_ids[begin:begin + _ROWS_PER_PASS]))
    ids, values, ranks = (torch.cat(tensors) for tensors in zip(*parts))
    return PromptLogprobs(spans, ids, values, ranks)
