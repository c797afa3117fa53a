"""Scheduler: which sequences run in the next step, and how many of their tokens.

There is no prefill or decode phase. Every sequence has `num_computed_tokens` catching up with
`num_tokens` within the step's token budget: a new prompt, a prompt chunk, a prefix-cache hit, the
recompute of a preempted sequence and a decode are the same mechanism. Running sequences are served
first, in priority order; waiting ones are then admitted head-of-line while budget, sequence slots and
KV blocks allow. When blocks run out, the lowest-priority, latest-arriving running sequence is
preempted: its blocks are freed and it is requeued to recompute its prompt and outputs. With
`preemption_mode="swap"` a long victim instead has its blocks copied to CPU blocks (the `swapped`
queue, served before any new admission) and keeps its computed tokens (ARCHITECTURE.md, "Swap").

`num_computed_tokens` advances when a chunk is scheduled, and a chunk that ends a sequence's tokens
marks one token pending until `update()` delivers it. So the next step can be scheduled while this one
still runs (async scheduling): a pending token is planned for like a known one, and the runner takes
its id from the device.

With an inter-token-latency target (`max_itl_ms`, Sarathi-Serve's stall-free batching) a step that
carries decodes takes only as many prompt tokens as the measured step costs (core/step_costs.py) allow
within the target, and at least `itl_min_prompt_tokens`, so prompts keep progressing. Order of service,
preemption and admission are unchanged: the target only lowers the step's token budget.

Owns the waiting and running queues and every sequence's status. Blocks are the BlockManager's;
tensors are the runner's (no torch here).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from minivllm.core.block_manager import BlockManager
from minivllm.core.interfaces import ModelOutput, SchedulerOutput
from minivllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from minivllm.core.step_costs import StepCosts


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority": lower priority value is served first, as in vLLM
    max_num_waiting: int | None = None  # admission control: add_seq_group raises SchedulerFullError beyond this
    # While at most `small_batch_max_seqs` sequences run, a step computes at most this many prompt tokens
    # (plus one per running sequence). Prompts arriving together are then prefilled one after another,
    # so the first gets its first token after one chunk's compute instead of all of them after the whole
    # batch's; a chunk big enough to be compute-bound loses nothing by the split. With many sequences
    # decoding the full budget applies: fewer, larger prefill steps interrupt fewer inter-token gaps.
    # Only with chunked prefill (a prompt must otherwise fit one step). None: off (the offline default;
    # `minivllm serve` turns it on).
    small_batch_prefill_tokens: int | None = None
    small_batch_max_seqs: int = 8
    # "recompute" | "swap" (None: recompute). Swap only victims with at least `swap_min_tokens` computed:
    # a short recompute rides along other steps almost free, a swap pays fixed copy and sync costs.
    preemption_mode: str | None = None
    swap_min_tokens: int = 512
    # Multi-LoRA: at most this many distinct adapters among running sequences (the runner's adapter slots).
    # None: no adapters.
    max_loras: int | None = None
    # Inter-token-latency target (ms): while decodes run, a step's prompt tokens are cut so that its estimated
    # cost stays within it, but never below `itl_min_prompt_tokens` (all it gets before any step is measured).
    # A mixed step is padded to a multiple of 64 tokens for its CUDA graph (worker/cuda_graph.py), so a smaller
    # chunk would save no time. None: off.
    max_itl_ms: float | None = None
    itl_min_prompt_tokens: int = 64

    def __post_init__(self) -> None:
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "small_batch_max_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a sequence must be computed in one step; a longer one would wait forever.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_model_len ({self.max_model_len}) when chunked prefill is disabled")
        if self.small_batch_prefill_tokens is not None and self.small_batch_prefill_tokens < 1:
            raise ValueError(f"small_batch_prefill_tokens must be at least 1, got {self.small_batch_prefill_tokens}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_itl_ms is not None and (self.max_itl_ms <= 0 or not self.enable_chunked_prefill):
            # Without chunking a prompt longer than the target allows could never be scheduled.
            raise ValueError(f"max_itl_ms must be positive and needs chunked prefill, got {self.max_itl_ms}")
        if self.itl_min_prompt_tokens < 1:
            raise ValueError(f"itl_min_prompt_tokens must be at least 1, got {self.itl_min_prompt_tokens}")
        if self.max_num_waiting is not None and self.max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be non-negative, got {self.max_num_waiting}")


class SchedulerFullError(RuntimeError):
    """The waiting queue is at `max_num_waiting`: the request is rejected, not queued."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        capacity = block_manager.num_blocks * block_manager.block_size
        if capacity < config.max_model_len:
            raise ValueError(f"the KV cache holds {capacity} tokens ({block_manager.num_blocks} blocks of "
                             f"{block_manager.block_size}), fewer than max_model_len ({config.max_model_len})")
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # kept sorted by _order_key
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # kept sorted by _order_key
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_discarded_steps = 0  # steps launched behind a verify step that rejected a draft, per sequence
        self.groups: dict[str, SequenceGroup] = {}  # unfinished requests by id
        # Measured step costs (fed by the engine through observe_step), only with an ITL target.
        self.step_costs = StepCosts() if config.max_itl_ms is not None else None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_group(self, request_id: str) -> SequenceGroup | None:
        return self.groups.get(request_id)

    def _order_key(self, seq: Sequence) -> tuple:
        priority = seq.priority if self.config.policy == "priority" else 0
        return (priority, seq.arrival_time, seq.index)

    # ---- requests in and out ------------------------------------------------------------------

    def add_seq_group(self, group: SequenceGroup) -> None:
        if group.request_id in self.groups:
            raise ValueError(f"request id {group.request_id!r} is already in use")
        seq = group.seqs[0]
        if not 0 < seq.num_tokens <= self.config.max_model_len:
            raise ValueError(f"prompt has {seq.num_tokens} tokens; it must have 1 to "
                             f"max_model_len ({self.config.max_model_len})")
        if group.sampling_params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({group.sampling_params.n}) must not exceed max_num_seqs ({self.config.max_num_seqs})")
        if self.config.max_num_waiting is not None and self.num_waiting >= self.config.max_num_waiting:
            raise SchedulerFullError(f"{self.num_waiting} requests are waiting already "
                                     f"(max_num_waiting={self.config.max_num_waiting})")
        assert len(group.seqs) == 1 and seq.status is SequenceStatus.WAITING
        self.groups[group.request_id] = group
        bisect.insort(self.waiting, seq, key=self._order_key)

    def abort_request(self, request_id: str) -> SequenceGroup | None:
        """Abort an unfinished request wherever it is; its blocks are freed now. None if unknown."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for seq in group.seqs:
            if not seq.is_finished:
                self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
        return group

    def finish_seq(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """End one sequence (also used by the engine for stop strings): frees its blocks, leaves its queue."""
        assert status.is_finished
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free_swapped(seq)
        else:
            queue = self.waiting if seq.status is SequenceStatus.WAITING else self.running
            queue.remove(seq)
            self.block_manager.free(seq)
        seq.status = status
        seq.stop_reason = stop_reason
        group = seq.group
        if group.is_finished:
            group.metrics.finished_time = time.monotonic()
            self.groups.pop(group.request_id, None)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        config, block_manager = self.config, self.block_manager
        budget = config.max_num_batched_tokens
        small_batch = len(self.running) <= config.small_batch_max_seqs
        if config.enable_chunked_prefill and config.small_batch_prefill_tokens and small_batch:
            budget = min(budget, config.small_batch_prefill_tokens + len(self.running))
        if self.step_costs is not None:
            budget = self._itl_budget(budget)
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False

        # 1. Running sequences, highest priority / earliest arrival first; the tail is the preemption victim.
        self.running.sort(key=self._order_key)
        # Later running sequences with work left: each keeps one token of budget, so a long chunk
        # never stalls the decodes behind it.
        num_behind = sum(seq.num_computed_tokens < seq.num_total_tokens for seq in self.running)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            drafts, seq.spec_token_ids = seq.spec_token_ids, []
            num_new = 0 if self._ends_with_pending_token(seq) else seq.num_total_tokens - seq.num_computed_tokens
            if num_new > 0:
                num_behind -= 1
            if config.enable_chunked_prefill:
                num_new = min(num_new, max(budget - num_behind, 1), budget)
            elif num_new > budget:
                num_new = 0  # must be computed whole: wait for a step with room
            if num_new == 0:
                i += 1
                continue
            # Drafts ride along a decode, as far as the budget allows: behind the last known token, or behind
            # the one still in flight (the runner takes its id from the device, as for any decode), which may
            # follow the drafts of a verify step in flight.
            if num_new != 1 or seq.num_pending_tokens > 1 + len(seq.drafts_in_flight):
                drafts = []
            drafts = drafts[:max(0, budget - num_behind - num_new)]
            while not block_manager.allocate_slots(seq, num_new + len(drafts)):
                if drafts:
                    drafts = []  # speculate less before preempting anyone
                    continue
                victim = self.running[-1]  # scheduled ones sit before i, so the tail is never one of them
                if victim is not seq and victim.num_computed_tokens < victim.num_total_tokens:
                    num_behind -= 1
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, num_new, drafts))
                budget -= num_new + len(drafts)
                i += 1

        # 2. Swapped sequences come back first, in order, when their blocks and their next tokens fit; none
        # while preempting. New prompts wait until every swapped sequence is back (no starvation).
        num_seq_slots = sum(1 + seq.num_pending_forks for seq in self.running)
        running_loras = ({seq.lora_int_id for seq in self.running} - {0}) if config.max_loras is not None else set()
        while self.swapped and budget > 0 and not preempted and num_seq_slots < config.max_num_seqs:
            seq = self.swapped[0]
            if not self._lora_fits(seq, running_loras):
                break
            num_new = seq.num_total_tokens - seq.num_computed_tokens
            if config.enable_chunked_prefill:
                num_new = min(num_new, budget)
            elif num_new > budget:
                break
            if not block_manager.can_swap_in(seq, num_new):
                break
            self.swapped.pop(0)
            block_manager.swap_in(seq)
            allocated = block_manager.allocate_slots(seq, num_new)
            assert allocated, "can_swap_in promised room"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            running_loras.add(seq.lora_int_id)
            if num_new:
                scheduled.append((seq, num_new, []))
            budget -= num_new
            num_seq_slots += 1

        # 3. Waiting sequences, head of line only; none while preempting (their blocks would be taken back).
        # A sequence whose prompt is not done yet will fork n - 1 siblings: their slots are taken now.
        while self.waiting and budget > 0 and not preempted and not self.swapped:
            seq = self.waiting[0]
            if num_seq_slots + 1 + seq.num_pending_forks > config.max_num_seqs:
                break
            if not self._lora_fits(seq, running_loras):
                break
            # Prompt logprobs need the hidden states of every prompt position: such prompts take no cache hit.
            wants_prompt_logprobs = seq.sampling_params.prompt_logprobs is not None and seq.num_output_tokens == 0
            computed_blocks, num_hit_tokens = ([], 0) if wants_prompt_logprobs else block_manager.get_computed_blocks(seq)
            num_new = seq.num_total_tokens - seq.num_computed_tokens - num_hit_tokens
            if config.enable_chunked_prefill:
                num_new = min(num_new, budget)
            elif num_new > budget:
                break
            if not block_manager.allocate_slots(seq, num_new, computed_blocks):
                break
            self.waiting.pop(0)
            seq.num_computed_tokens += num_hit_tokens
            group = seq.group
            if group.metrics.first_scheduled_time is None:
                group.num_cached_tokens = num_hit_tokens
                group.metrics.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            seq.spec_token_ids = []
            self.running.append(seq)
            running_loras.add(seq.lora_int_id)
            scheduled.append((seq, num_new, []))
            budget -= num_new
            num_seq_slots += 1 + seq.num_pending_forks

        # 4. A sequence samples only when this step reaches its last token (then once per pending fork too).
        output = SchedulerOutput(blocks_to_copy=block_manager.take_blocks_to_copy())
        output.blocks_to_swap_out, output.blocks_to_swap_in = block_manager.take_swaps()
        if any(drafts for _, _, drafts in scheduled):
            output.spec_token_ids = [drafts for _, _, drafts in scheduled]
        for seq, num_new, drafts in scheduled:
            output.seqs.append(seq)
            output.num_computed_tokens.append(seq.num_computed_tokens)
            output.num_scheduled_tokens.append(num_new + len(drafts))
            seq.num_computed_tokens += num_new + len(drafts)
            done = seq.num_computed_tokens >= seq.num_total_tokens
            output.num_samples.append(1 + seq.num_pending_forks if done else 0)
            output.num_discarded_steps.append(seq.num_discarded_steps)
            if done:
                seq.num_pending_tokens += 1 + len(drafts)
                seq.drafts_in_flight = drafts
        return output

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A plain step of `num_tokens` cost `seconds` on the device (start to the next step's start)."""
        if self.step_costs is not None:
            self.step_costs.observe(num_tokens, 0, seconds, speculative=False)

    def _itl_budget(self, budget: int) -> int:
        """The step's token budget under the ITL target: the decodes' tokens (drafts included) plus the most
        prompt tokens that keep the step's estimated cost within the target, and at least the minimum chunk.
        Unchanged when no decode runs (nobody's next token waits on this step) or no prompt work is left."""
        num_decode_tokens, prompt_work = 0, bool(self.waiting or self.swapped)
        for seq in self.running:
            behind = seq.num_total_tokens - seq.num_computed_tokens
            if behind > 1:
                prompt_work = True
            elif behind == 1 and not self._ends_with_pending_token(seq):
                num_decode_tokens += 1 + len(seq.spec_token_ids)
        if not num_decode_tokens or not prompt_work:
            return budget
        within = self.step_costs.tokens_within(self.config.max_itl_ms / 1e3)
        num_prompt_tokens = max(self.config.itl_min_prompt_tokens, (within or 0) - num_decode_tokens)
        return min(budget, num_decode_tokens + num_prompt_tokens)

    def _lora_fits(self, seq: Sequence, running_loras: set[int]) -> bool:
        """Whether `seq` may join the running sequences without needing more adapter slots than there are
        (head of line: a sequence waiting for a slot holds back those behind it, as one waiting for blocks does)."""
        if self.config.max_loras is None:
            return True
        lora_id = seq.lora_int_id
        return not lora_id or lora_id in running_loras or len(running_loras - {0}) < self.config.max_loras

    def _ends_with_pending_token(self, seq: Sequence) -> bool:
        """The token in flight will end this sequence by length: computing past it would be wasted."""
        if not seq.num_pending_tokens:
            return False
        max_tokens = seq.sampling_params.max_tokens
        return ((max_tokens is not None and seq.num_output_tokens + seq.num_pending_tokens >= max_tokens)
                or seq.num_total_tokens >= self.config.max_model_len)

    def _preempt(self, seq: Sequence) -> None:
        """Free all of `seq`'s blocks and requeue it; it keeps its outputs and recomputes them as prompt.
        Or, when swapping applies, its blocks move to CPU blocks and it keeps its computed tokens."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self._should_swap(seq):
            self.block_manager.swap_out(seq)
            seq.spec_token_ids = []
            seq.status = SequenceStatus.SWAPPED
            self.num_swap_outs += 1
            bisect.insort(self.swapped, seq, key=self._order_key)
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._order_key)

    def _should_swap(self, seq: Sequence) -> bool:
        """Swap a long victim whose blocks are all its own. It may be in the step in flight: the swap-out
        copies run after that step's KV writes, and its sampled token reaches it in update() before it
        can be swapped back in. Not when drafts are in flight (their rollback needs RUNNING), when a
        sibling is still to be forked from it, or when the token in flight ends it anyway."""
        return (self.config.preemption_mode == "swap" and seq.num_computed_tokens >= self.config.swap_min_tokens
                and seq.num_computed_tokens <= seq.num_tokens and not seq.num_pending_forks
                and not self._ends_with_pending_token(seq) and self.block_manager.can_swap_out(seq))

    def update(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> list[SequenceGroup]:
        """Append sampled tokens, register newly full blocks, fork n > 1 requests, finish sequences.

        Returns the groups that got tokens or finished in this step, each once, in schedule order.
        """
        touched: dict[str, SequenceGroup] = {}
        now = time.monotonic()
        num_spec_tokens = scheduler_output.num_spec_tokens
        for i, seq in enumerate(scheduler_output.seqs):
            if seq.is_finished or scheduler_output.is_discarded(i):
                continue  # aborted or stopped since schedule(), or discarded: its tokens are dropped
            # A sequence preempted after this step was scheduled still takes its sampled token: it is
            # the right continuation, and the recompute will include it.
            token_ids = model_output.sampled_token_ids[i] if model_output.sampled_token_ids else []
            if num_spec_tokens[i]:
                self._update_speculative(seq, num_spec_tokens[i], token_ids, model_output, i)
                touched[seq.request_id] = seq.group
                continue
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_blocks(seq)
            assert len(token_ids) == scheduler_output.num_samples[i], "runner sampled the wrong count"
            if not token_ids:
                continue
            seq.num_pending_tokens -= 1
            if not seq.num_pending_tokens:
                seq.drafts_in_flight = []
            group = seq.group
            seqs = [seq]
            for k in range(1, len(token_ids)):  # the prompt is done: the other n - 1 samples start here
                child = seq.fork(index=k)
                group.seqs.append(child)
                if seq.status is SequenceStatus.RUNNING:
                    self.block_manager.fork(seq, child)
                    self.running.append(child)
                else:  # the parent was preempted meanwhile: the sibling recomputes too
                    child.num_computed_tokens = 0
                    bisect.insort(self.waiting, child, key=self._order_key)
                seqs.append(child)
            for k, (target, token_id) in enumerate(zip(seqs, token_ids)):
                logprobs = model_output.logprobs[i][k] if model_output.logprobs is not None else None
                target.append_token(token_id, logprobs)
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            group.metrics.last_token_time = now
            touched[group.request_id] = group
            for target in seqs:
                self._check_stop(target)
        return list(touched.values())

    def stop_before_end(self, seq: Sequence, stop_string: str) -> None:
        """A stop string matched before the last token a verified step delivered: the sequence ends
        there, by that string, as it would have had the tokens come one per step (the engine drops the
        later tokens). It may have finished already, on a later token of the same step."""
        if seq.is_finished:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_string
        else:
            self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED, stop_string)

    def _update_speculative(self, seq: Sequence, num_drafts: int, token_ids: list[int], model_output: ModelOutput,
                            index: int) -> None:
        """Take a verified step's accepted drafts plus one token; roll back the rejected drafts' KV, and
        discard the step launched behind this one, which assumed every draft accepted."""
        num_accepted = len(token_ids) - 1
        assert 0 <= num_accepted <= num_drafts, "runner returned the wrong number of verified tokens"
        seq.num_pending_tokens -= 1 + num_drafts
        rejected = num_accepted < num_drafts
        if rejected and seq.num_pending_tokens:
            seq.num_discarded_steps += 1
            self.num_discarded_steps += 1
            seq.num_pending_tokens = 0
        if not seq.num_pending_tokens:
            seq.drafts_in_flight = []
        if seq.status is SequenceStatus.RUNNING:
            # Rejected positions (and any computed behind them) hold KV of tokens that are not in the
            # sequence: no longer computed, and the blocks only they used go back (no hash was ever taken
            # of them). Their KV is overwritten before it is read again.
            if rejected:
                seq.num_computed_tokens = seq.num_tokens + num_accepted
            self.block_manager.cache_blocks(seq)
        group, now = seq.group, time.monotonic()
        group.metrics.spec_num_draft_tokens += num_drafts
        group.metrics.spec_num_accepted_tokens += num_accepted
        logprobs = model_output.logprobs[index] if model_output.logprobs is not None else [None] * len(token_ids)
        for token_id, token_logprobs in zip(token_ids, logprobs):
            seq.append_token(token_id, token_logprobs)
            self._check_stop(seq)
            if seq.is_finished:
                break  # tokens after a stop are dropped, exactly as if they had come one per step
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.trim(seq)
        group.metrics.last_token_time = now

    # ---- observation --------------------------------------------------------------------------

    def snapshot(self, max_per_queue: int = 200) -> dict:
        """Plain data for a dashboard: each queue's first `max_per_queue` sequences and its full length.
        A waiting sequence that has been preempted before is listed as preempted."""
        def entry(seq: Sequence) -> dict:
            params = seq.sampling_params
            return {"request_id": seq.request_id, "index": seq.index, "priority": seq.priority,
                    "prompt_tokens": seq.num_prompt_tokens, "output_tokens": seq.num_output_tokens,
                    "max_tokens": params.max_tokens, "computed_tokens": seq.num_computed_tokens,
                    "cached_tokens": seq.group.num_cached_tokens, "num_blocks": len(seq.block_table),
                    "num_preemptions": seq.num_preemptions}

        preempted = [seq for seq in self.waiting if seq.num_preemptions > 0]
        waiting = [seq for seq in self.waiting if seq.num_preemptions == 0]
        return {"running": [entry(s) for s in self.running[:max_per_queue]],
                "waiting": [entry(s) for s in waiting[:max_per_queue]],
                "preempted": [entry(s) for s in preempted[:max_per_queue]],
                "num_running": len(self.running), "num_waiting": len(waiting), "num_preempted": len(preempted),
                "num_preemptions": self.num_preemptions, "num_swapped": len(self.swapped)}

    def _check_stop(self, seq: Sequence) -> None:
        params = seq.sampling_params
        token_id = seq.token_ids[-1]
        if seq.num_output_tokens >= params.min_tokens and (
                token_id in params.all_stop_token_ids or token_id in params.stop_token_ids):
            stop_reason = token_id if token_id in params.stop_token_ids else None  # None: it was eos
            self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED, stop_reason)
        elif ((params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
              or seq.num_tokens >= self.config.max_model_len):
            self.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
