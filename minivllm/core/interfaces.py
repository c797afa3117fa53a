"""The two contracts that cross between the scheduler and the model runner; plain Python, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.core.sequence import SampleLogprobs, Sequence


@dataclass
class SchedulerOutput:
    """What to run this step.

    For each scheduled sequence `seqs[i]`, the runner computes the tokens at positions
    `num_computed_tokens[i] : num_computed_tokens[i] + num_scheduled_tokens[i]` and, when
    `num_samples[i] > 0`, samples that many tokens from the logits of the last of them
    (more than one only when a request with n > 1 finishes its prompt and forks).
    Before the forward pass the runner copies whole KV blocks `src -> dst` (copy-on-write).
    With async scheduling the last of those positions may hold a token still being sampled by the step in
    flight (`seq.num_pending_tokens`); the runner takes it from that step's device output.
    `num_computed_tokens` is the chunk's start; empty means "each sequence's current value".
    `spec_token_ids[i]` (empty list when none, or the whole list empty when no sequence speculates) are
    draft tokens appended to the chunk: the runner verifies them and samples num_drafts + 1 positions,
    returning 1 to num_drafts + 1 tokens for that sequence.
    """
    seqs: list[Sequence] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # Swap-to-CPU preemption, applied before blocks_to_copy: first GPU block -> CPU block (the GPU blocks
    # may be reused by this very step), then CPU block -> GPU block.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Each sequence's `num_discarded_steps` when scheduled: a sequence whose count has changed by the time
    # the step is read back takes none of its tokens (see Scheduler.update).
    num_discarded_steps: list[int] = field(default_factory=list)

    @property
    def num_spec_tokens(self) -> list[int]:
        return [len(d) for d in self.spec_token_ids] if self.spec_token_ids else [0] * len(self.seqs)

    @property
    def num_sampling_rows(self) -> list[int]:
        """Rows of logits the runner samples for each sequence, in order: `num_samples`, or num_drafts + 1
        for a sequence verifying drafts."""
        return [d + 1 if d else n for n, d in zip(self.num_samples, self.num_spec_tokens)]

    def is_discarded(self, i: int) -> bool:
        """Whether sequence i's part of this step was discarded after it was scheduled."""
        return bool(self.num_discarded_steps) and self.seqs[i].num_discarded_steps != self.num_discarded_steps[i]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class ModelOutput:
    """Sampled tokens for each scheduled sequence, in `SchedulerOutput.seqs` order ([] when none); a
    speculating sequence gets its accepted drafts followed by one sampled token."""
    sampled_token_ids: list[list[int]]
    logprobs: list[list[SampleLogprobs]] | None = None
    # Sequences asking for prompt logprobs: index in `seqs` -> (prompt position of the first entry,
    # the logprobs of prompt tokens from that position on that this step's chunk computed).
    prompt_logprobs: dict[int, tuple[int, list[SampleLogprobs]]] | None = None
