"""Request state: a `Sequence` is one stream of tokens; a `SequenceGroup` is one request (n >= 1 sequences).

Owns token ids, the computed-token counter and the block table of each sequence. The block table is
written only by the BlockManager; status only by the Scheduler.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from minivllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"        # in the waiting queue (new, or preempted and waiting for recompute)
    RUNNING = "running"        # holds blocks, scheduled every step until finished
    SWAPPED = "swapped"        # preempted with its KV copied to CPU blocks; waits to be swapped back in
    FINISHED_STOPPED = "stop"  # eos, stop token id or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass
class SampleLogprobs:
    """Logprobs of one sampled token: the chosen id first, then the top-n ids, and the chosen one's rank."""
    token_ids: list[int]
    logprobs: list[float]
    rank: int


_seq_counter = itertools.count()


class Sequence:
    def __init__(self, group: SequenceGroup, token_ids: list[int], index: int = 0,
                 num_prompt_tokens: int | None = None) -> None:
        self.seq_id = next(_seq_counter)
        self.group = group
        self.index = index  # position among the request's n samples
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.num_computed_tokens = 0
        # Tokens a step still in flight (async scheduling) may add, not yet appended to token_ids: its
        # sample, plus the drafts of a verify step (counted as if all accepted, so that the next step can
        # be scheduled behind it; a rejection discards that step for this sequence).
        self.num_pending_tokens = 0
        self.drafts_in_flight: list[int] = []  # the drafts among those pending tokens
        # Steps in flight discarded for this sequence (launched behind a verify step whose drafts were not
        # all accepted): a scheduled step remembers the count and its tokens are dropped if it changed.
        self.num_discarded_steps = 0
        self.block_table: list[int] = []
        # Draft tokens to verify in the next step (speculative decoding), set before scheduling; -1
        # marks a draft the runner's device proposer fills in. Cleared when the step is scheduled.
        self.spec_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_logprobs: list[SampleLogprobs] = []
        self.num_preemptions = 0

    # Shortcuts to the request-level state.
    @property
    def request_id(self) -> str:
        return self.group.request_id

    @property
    def sampling_params(self) -> SamplingParams:
        return self.group.sampling_params

    @property
    def priority(self) -> int:
        return self.group.priority

    @property
    def arrival_time(self) -> float:
        return self.group.arrival_time

    @property
    def lora_int_id(self) -> int:
        """The request's adapter (0: the base model)."""
        request = self.group.lora_request
        return 0 if request is None else request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_total_tokens(self) -> int:
        """Tokens known plus tokens being sampled right now: what the scheduler plans with."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_pending_forks(self) -> int:
        """Sibling samples still to be forked from this sequence once its prompt is computed."""
        if self.index != 0 or len(self.group.seqs) > 1 or self.num_output_tokens + self.num_pending_tokens > 0:
            return 0
        return self.sampling_params.n - 1

    def append_token(self, token_id: int, logprobs: SampleLogprobs | None = None) -> None:
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def truncate(self, num_tokens: int) -> None:
        """Drop tokens past `num_tokens` (and their logprobs) of a finished sequence: a stop string
        matched before the end of a multi-token (speculative) step."""
        assert self.is_finished and num_tokens >= self.num_prompt_tokens
        del self.output_logprobs[num_tokens - self.num_prompt_tokens:]
        del self.token_ids[num_tokens:]

    def fork(self, index: int) -> Sequence:
        """A sibling sharing the prompt: its one token (appended by the caller) is the last not computed.
        Its blocks are shared by the BlockManager."""
        child = Sequence(self.group, self.token_ids[:self.num_prompt_tokens], index, self.num_prompt_tokens)
        child.num_computed_tokens = self.num_prompt_tokens
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, idx={self.index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.name})")


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: draft tokens verified for this request, and how many were accepted.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass
class SequenceGroup:
    """One request: its prompt, parameters, timing and the sequences sampling it."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    metrics: RequestMetrics | None = None
    # With `prompt_logprobs`: per prompt position (the first stays None), filled chunk by chunk.
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    lora_request: Any = None  # a minivllm.lora.LoRARequest; only its lora_int_id is read here

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if not self.seqs:
            self.seqs.append(Sequence(self, self.prompt_token_ids))

    @property
    def is_finished(self) -> bool:
        # A request aborted before its prompt was done never forks its other n - 1 samples.
        forked = (len(self.seqs) == self.sampling_params.n
                  or self.seqs[0].status is SequenceStatus.FINISHED_ABORTED)
        return forked and all(s.is_finished for s in self.seqs)
