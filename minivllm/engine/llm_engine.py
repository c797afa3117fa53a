"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

A step is three calls: `scheduler.schedule()` -> `runner.execute()` -> `scheduler.update()`; then the
detokenizer turns new token ids into text and checks stop strings. The engine owns tokenization and
request validation; it knows nothing about HTTP and never touches tensors.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

from minivllm.config import EngineConfig
from minivllm.core.block_manager import BlockManager
from minivllm.core.interfaces import SchedulerOutput
from minivllm.core.scheduler import Scheduler, SchedulerConfig
from minivllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.step_times import StepTimes
from minivllm.engine.tokenizer import load_tokenizer
from minivllm.models.loader import resolve_model
from minivllm.models.registry import applies_sliding_window
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.controller import SpecDecodeStats, SpeculationController
from minivllm.structured_output import StructuredOutputManager
from minivllm.worker.executor import create_executor
from minivllm.worker.model_runner import PendingModelOutput, StepStart

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    spec_decode: SpecDecodeStats | None = None
    num_swapped: int = 0    # requests whose KV is swapped out to CPU now
    num_swap_outs: int = 0  # preemptions that swapped (the rest recomputed)
    # Multi-LoRA: adapter names of running and waiting requests, and the slots (None: LoRA off).
    running_lora_adapters: list[str] | None = None
    waiting_lora_adapters: list[str] | None = None
    max_lora: int | None = None
    step_times: StepTimes | None = None   # the engine's live step histograms (read, never changed, by /metrics)


@dataclass
class _Launch:
    """A timed step, as the read-back of the step after it prices it."""
    num_tokens: int
    num_seqs: int
    verified: bool               # it verified drafts
    started: StepStart
    ended: StepStart | None
    waited_for_verify: bool      # launched only once the verify step before it was read back
    discarded: bool = False      # every sequence's part was dropped (it bet on drafts that were then rejected)


class _InFlightStep(NamedTuple):
    scheduler_output: SchedulerOutput
    pending: PendingModelOutput
    needs_sync: bool  # penalties: read back before scheduling the next step
    previous: _Launch | None = None  # the step launched before it, priced at this one's read-back
    launch: _Launch | None = None    # this step, once timed


class _SeqOutputState:
    """Per-sequence output bookkeeping: detokenizer and the logprobs converted so far."""

    def __init__(self, detokenizer: IncrementalDetokenizer | None) -> None:
        self.detokenizer = detokenizer
        self.num_seen = 0
        self.logprobs: list[dict[int, Logprob]] = []


def _eos_token_ids(tokenizer, hf_config) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        started = time.perf_counter()
        source = resolve_model(config.model, config.load_format)
        resolved = time.perf_counter()
        self.model_name = source.name
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or source.tokenizer_dir)
        # Seconds of each start-up phase, the runner's included (`minivllm serve` logs and exports them).
        self.startup_seconds = {"resolve_model": resolved - started, "tokenizer": time.perf_counter() - resolved}
        hf = source.hf_config

        model_max_len = getattr(hf, "max_position_embeddings", None) or 2048
        window = getattr(hf, "sliding_window", None)
        if window and getattr(hf, "use_sliding_window", True) and not applies_sliding_window(hf):
            # A model that does not apply its window (Mistral here) stays inside one, where it is exact.
            model_max_len = min(model_max_len, window)
        self.max_model_len = config.max_model_len or model_max_len
        if self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context length {model_max_len}")
        chunked = config.enable_chunked_prefill
        max_batched = config.max_num_batched_tokens or max(4096 if chunked else self.max_model_len, config.max_num_seqs)
        if not chunked and max_batched < self.max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({max_batched}) must be at least "
                             f"max_model_len ({self.max_model_len})")
        if max_batched < config.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_batched}) must be at least max_num_seqs ({config.max_num_seqs})")

        self.runner = create_executor(config, source, max_batched)  # the ModelRunner, or TP ranks behind one
        self.quantization = getattr(getattr(self.runner.model, "quant_config", None), "name", None)
        if self.runner.num_kv_tokens < self.max_model_len:
            if config.max_model_len is not None:
                raise ValueError(f"the KV cache holds {self.runner.num_kv_tokens} tokens, fewer than max_model_len "
                                 f"{self.max_model_len}; give it more memory or lower max_model_len")
            logger.warning("max_model_len lowered from %d to %d to fit the KV cache", self.max_model_len,
                           self.runner.num_kv_tokens)
            self.max_model_len = self.runner.num_kv_tokens
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          num_cpu_blocks=getattr(self.runner, "num_cpu_blocks", 0))
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=self.max_model_len,
            enable_chunked_prefill=chunked, policy=config.scheduling_policy, max_num_waiting=config.max_num_waiting,
            small_batch_prefill_tokens=config.small_batch_prefill_tokens, preemption_mode=config.preemption_mode,
            max_loras=config.max_loras if config.enable_lora else None, max_itl_ms=config.max_itl_ms),
            self.block_manager)
        self.runner.capture_cuda_graphs(config.max_num_seqs, self.max_model_len)
        self.startup_seconds.update(getattr(self.runner, "startup_seconds", {}))
        self.eos_token_ids = _eos_token_ids(self.tokenizer, hf)
        self.vocab_size = hf.vocab_size
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._outputs: dict[int, _SeqOutputState] = {}
        self._prompt_logprobs_out: dict[str, list] = {}  # request id -> RequestOutput.prompt_logprobs
        self._in_flight: _InFlightStep | None = None
        self._last_launch: _Launch | None = None   # the last step launched, while the engine has work
        self._unpriced: list[tuple] = []            # (step, the next step's pending output, its launch), read back
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        spec_config = SpeculativeConfig.from_dict(config.speculative_config)
        self.spec = None if spec_config is None else SpeculationController(spec_config, self.max_model_len)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.step_times = StepTimes()
        # Every step's start and end on the device, for the histograms; the ITL target's cost model times them anyway.
        self._times_every_step = config.collect_step_times or self.scheduler.step_costs is not None
        logger.info("engine ready: %s, max_model_len %d, %d KV tokens", self.model_name, self.max_model_len,
                    self.runner.num_kv_tokens)

    # ---- requests -------------------------------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids (skip_tokenizer_init is set)")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return None, token_ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0, lora_request=None) -> None:
        """`lora_request`: a minivllm.lora.LoRARequest; its adapter is read on first use (ValueError if bad)."""
        params = params or SamplingParams()
        if lora_request is not None:
            self.add_lora(lora_request)
        text, token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but the model's context length is "
                             f"{self.max_model_len} tokens (the prompt must leave room for at least one output token)")
        if params.logit_bias and any(not 0 <= t < self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        params.all_stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        self.structured_output.compile(params)
        group = SequenceGroup(request_id=request_id, prompt=text, prompt_token_ids=token_ids, sampling_params=params,
                              arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
                              priority=priority, lora_request=lora_request)
        self.scheduler.add_seq_group(group)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ----------------------------------------------
    def _lora_manager(self):
        manager = getattr(self.runner, "lora_manager", None)
        if manager is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        return manager

    def add_lora(self, lora_request) -> bool:
        """Read and check an adapter; False when it is known already. ValueError when it cannot be served."""
        return self._lora_manager().add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests admitted with it still finish with it); False when unknown."""
        return self._lora_manager().remove_adapter(lora_int_id)

    def list_loras(self) -> list:
        return self._lora_manager().list_adapters()

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self.scheduler.abort_request(rid)
            if group is not None:
                for seq in group.seqs:
                    self._outputs.pop(seq.seq_id, None)
                    if self.spec is not None:
                        self.spec.forget(seq.seq_id, seq.output_token_ids)
                self._prompt_logprobs_out.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ---- the step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step that finished.

        With async scheduling the host schedules and launches step N before it reads step N's
        predecessor back, so CPU bookkeeping overlaps GPU work and the outputs trail by one step.
        Penalties need every previous token on the host, so a step using them is read back before the
        next is scheduled, and so is a step that samples some request's first token, which then goes out
        before the next step runs instead of after it.
        """
        # A device proposer, grammar-checked drafts and seeded sampling need every token on the host: a
        # step that may speculate with them first reads back the step in flight (n-gram lookups need
        # not otherwise, see spec_decode/controller.py). Its outputs (detokenization, stop strings) are
        # made after the next step is launched, while the GPU runs.
        num_drafts = self.spec.choose_k(self.scheduler.running) if self.spec is not None else 0
        synced: list[SequenceGroup] = []
        waited_for_verify = False
        if self._in_flight is not None and (self._in_flight.needs_sync or (
                num_drafts and not self.spec.proposes_behind(self.scheduler.running))):
            waited_for_verify = bool(self._in_flight.scheduler_output.spec_token_ids)
            synced = self._update_in_flight(price_later=True)
        if self.spec is not None and self.spec.propose(self.scheduler.running, num_drafts):
            self.structured_output.truncate_drafts(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        launched = None
        read_back_now = not self.async_scheduling
        if not scheduler_output.is_empty:
            # Read back before the next step is scheduled: a step with penalties (they need every token on the
            # host), a verify step (a variable number of tokens) unless the next step may bet that every draft
            # is accepted (SpeculationController.chains), and a step that samples some request's first token,
            # which so skips the one-step lag (time to first token matters more than overlapping the long
            # prefill steps that make it). Read back at the end of this call instead, it would hold back the
            # outputs of the step before it, which this call returns: every running decode would get two
            # tokens a step late, each time a prompt completes.
            bitmask = None
            if self.structured_output.is_constrained(scheduler_output):
                bitmask = functools.partial(self._grammar_bitmask, scheduler_output, synced)
            # With speculation, an ITL target or `collect_step_times` the step is timed on the device: the next step
            # launched prices it. Its end is recorded for a verify step (the controller's idle time after it) or
            # when every step is timed (the histograms).
            timed = self._times_every_step or self.spec is not None
            timed_end = self._times_every_step or bool(timed and scheduler_output.spec_token_ids)
            pending = self.runner.execute_async(scheduler_output, bitmask, timed, timed_end)
            self._price_steps()   # the step read back above, priced now that the device has this one
            needs_sync = (bool(scheduler_output.spec_token_ids) and not self.spec.chains(scheduler_output)) or any(
                seq.sampling_params.uses_penalties or (n and seq.num_output_tokens == 0)
                for seq, n in zip(scheduler_output.seqs, scheduler_output.num_samples))
            self.step_times.observe_launch(scheduler_output.total_num_scheduled_tokens)
            launch = None if pending.started is None else _Launch(
                scheduler_output.total_num_scheduled_tokens, len(scheduler_output.seqs),
                bool(scheduler_output.spec_token_ids), pending.started, pending.ended, waited_for_verify)
            launched = _InFlightStep(scheduler_output, pending, needs_sync, self._last_launch, launch)
            # A step can carry drafts with no controller set: bench/spec_decode.py's compare part, which switches
            # controllers between runs, hit that on an H200 (how such a step arose is not established; the same
            # run on the CPU with async scheduling does not). Verification needs no controller, only its counters.
            if self.spec is not None:
                if self._in_flight is not None and self._in_flight.scheduler_output.spec_token_ids:
                    self.spec.num_chained_steps += 1   # launched behind a verify step not yet read back
        self._price_steps()
        outputs = [self._make_output(group) for group in synced]
        if self._in_flight is not None:
            outputs += self._complete_in_flight()
        self._in_flight = launched
        if read_back_now and self._in_flight is not None:
            outputs += self._complete_in_flight()
        # The chain breaks when the engine runs dry (or no step is timed).
        self._last_launch = launched.launch if launched is not None and self.scheduler.has_unfinished_requests() else None
        return outputs

    def _grammar_bitmask(self, scheduler_output: SchedulerOutput, synced: list[SequenceGroup],
                         device_drafts: dict[int, list[int]] | None = None):
        """The step's grammar mask, filled by the runner's call once the forward pass is launched. The step
        before it, still in flight, is read back first: its tokens advance the grammar matchers.
        `device_drafts`: the drafts the runner's proposer made for this step (they decide verified rows)."""
        if self._in_flight is not None:
            synced += self._update_in_flight()
        return self.structured_output.grammar_bitmask(scheduler_output, device_drafts)

    def _complete_in_flight(self) -> list[RequestOutput]:
        return [self._make_output(group) for group in self._update_in_flight()]

    def _update_in_flight(self, price_later: bool = False) -> list[SequenceGroup]:
        """Read the step in flight back and hand its tokens to the scheduler; returns the groups touched.
        `price_later`: the device times of the step before it go to the cost models at the next `_price_steps`,
        not now (the caller launches a step first: after a verify step the device idles until then)."""
        scheduler_output, pending, _, previous, launch = self._in_flight
        self._in_flight = None
        model_output = pending.result()
        if previous is not None:
            self._unpriced.append((previous, pending, launch))
        if not price_later:
            self._price_steps()
        if launch is not None and scheduler_output.num_discarded_steps:
            launch.discarded = all(scheduler_output.is_discarded(i) for i in range(len(scheduler_output.seqs)))
        if model_output.prompt_logprobs:
            self._store_prompt_logprobs(scheduler_output, model_output.prompt_logprobs)
        self._count_tokens(scheduler_output, model_output)
        return self.scheduler.update(scheduler_output, model_output)

    def _price_steps(self) -> None:
        """Hand the device times of the steps read back since the last call to the cost models: each step's cost,
        from its start on the device to the next step's start (its device time, plus the time the device then
        idled for the host, as after a verify step that was waited for). The chain breaks when the engine runs
        dry, so idle time between requests is no step's cost."""
        for previous, pending, launch in self._unpriced:
            seconds = previous.started.seconds_until(pending.started)
            if self._times_every_step:
                self.step_times.observe_device(previous.started.seconds_until(previous.ended),
                                               previous.ended.seconds_until(pending.started))
            if self.spec is not None:
                self.spec.observe_step(previous.num_tokens, previous.num_seqs, seconds, previous.verified)
                if previous.verified and previous.ended is not None:   # the device's idle behind a verify step
                    self.spec.observe_idle_after_verify(previous.ended.seconds_until(pending.started),
                                                        launch.waited_for_verify)
                if previous.discarded:
                    self.spec.observe_discarded_step(seconds)
            if not previous.verified:
                self.scheduler.observe_step(previous.num_tokens, seconds)
        self._unpriced.clear()

    def _count_tokens(self, scheduler_output, model_output) -> None:
        """Prompt tokens computed this step (the part of each chunk inside the prompt) and tokens generated."""
        discarded = [scheduler_output.is_discarded(i) for i in range(len(scheduler_output.seqs))]
        for seq, start, n, samples, dropped in zip(scheduler_output.seqs, scheduler_output.num_computed_tokens,
                                                   scheduler_output.num_scheduled_tokens,
                                                   model_output.sampled_token_ids, discarded):
            if not dropped:
                self.num_prompt_tokens += max(0, min(start + n, seq.num_prompt_tokens) - start)
                self.num_generation_tokens += len(samples)
        if scheduler_output.spec_token_ids and self.spec is not None:
            for seq, drafts, samples, dropped in zip(scheduler_output.seqs, scheduler_output.spec_token_ids,
                                                     model_output.sampled_token_ids, discarded):
                if drafts and samples and not dropped and not seq.is_finished:   # (not aborted meanwhile)
                    self.spec.observe_verification(seq, len(drafts), len(samples) - 1)

    @staticmethod
    def _store_prompt_logprobs(scheduler_output: SchedulerOutput, entries: dict) -> None:
        for i, (first, logprobs) in entries.items():
            group = scheduler_output.seqs[i].group
            if group.prompt_logprobs is None:
                group.prompt_logprobs = [None] * len(group.prompt_token_ids)
            group.prompt_logprobs[first:first + len(logprobs)] = logprobs

    def _prompt_logprobs(self, group: SequenceGroup) -> list[dict[int, Logprob] | None] | None:
        """vLLM's shape: None for the first prompt token, then {token id: Logprob} (the prompt token first)."""
        if group.sampling_params.prompt_logprobs is None:
            return None
        cached = self._prompt_logprobs_out.get(group.request_id)
        if cached is not None:
            return cached
        decode = (lambda tid: None) if self.tokenizer is None else (
            lambda tid: self.tokenizer.decode([tid], skip_special_tokens=False))
        # Complete once the prompt is (the first output comes after its last chunk): converted once.
        self._prompt_logprobs_out[group.request_id] = result = [
            None if lp is None else {tid: Logprob(value, rank=lp.rank if k == 0 else k, decoded_token=decode(tid))
                                     for k, (tid, value) in enumerate(zip(lp.token_ids, lp.logprobs))}
            for lp in group.prompt_logprobs or [None]]  # a one-token prompt scores nothing
        return result

    def _seq_state(self, seq: Sequence) -> _SeqOutputState:
        state = self._outputs.get(seq.seq_id)
        if state is None:
            detok = None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, seq.sampling_params)
            state = self._outputs[seq.seq_id] = _SeqOutputState(detok)
        return state

    def _completion(self, seq: Sequence) -> CompletionOutput:
        state = self._seq_state(seq)
        new_ids = seq.token_ids[seq.num_prompt_tokens + state.num_seen:]
        if new_ids:
            if state.detokenizer is not None:
                self._detokenize(seq, state, new_ids)
            else:
                state.num_seen += len(new_ids)
            for lp in seq.output_logprobs[len(state.logprobs):]:
                state.logprobs.append({
                    tid: Logprob(value, rank=lp.rank if k == 0 else k,
                                 decoded_token=state.detokenizer.decode_token(tid) if state.detokenizer else None)
                    for k, (tid, value) in enumerate(zip(lp.token_ids, lp.logprobs))})
        params = seq.sampling_params
        return CompletionOutput(
            index=seq.index,
            text=state.detokenizer.output_text if state.detokenizer is not None else "",
            token_ids=seq.output_token_ids,
            cumulative_logprob=sum(d[t].logprob for d, t in zip(state.logprobs, seq.output_token_ids))
            if params.logprobs is not None else None,
            logprobs=list(state.logprobs) if params.logprobs is not None else None,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _detokenize(self, seq: Sequence, state: _SeqOutputState, new_ids: list[int]) -> None:
        """Feed new ids to the detokenizer. Several ids at once (a verified speculative step) go one by one
        when the request has stop strings: a match ends the sequence at that token, as it would have
        without speculation, and the later ids are dropped."""
        chunks = [new_ids] if len(new_ids) == 1 or not seq.sampling_params.stop else [[t] for t in new_ids]
        for n, chunk in enumerate(chunks):
            last = n == len(chunks) - 1
            state.num_seen += len(chunk)
            _, stop_string = state.detokenizer.update(chunk, finished=seq.is_finished and last)
            if stop_string is None:
                continue
            if last:
                self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED, stop_string)
            else:
                self.scheduler.stop_before_end(seq, stop_string)
                seq.truncate(seq.num_prompt_tokens + state.num_seen)
            return

    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        outputs = [self._completion(seq) for seq in sorted(group.seqs, key=lambda s: s.index)]
        finished = group.is_finished
        prompt_logprobs = self._prompt_logprobs(group)
        if finished:
            for seq in group.seqs:
                self._outputs.pop(seq.seq_id, None)
                if self.spec is not None:
                    self.spec.forget(seq.seq_id, seq.output_token_ids)
            if group.metrics.finished_time is None:
                group.metrics.finished_time = time.monotonic()
            self._prompt_logprobs_out.pop(group.request_id, None)
        return RequestOutput(request_id=group.request_id, prompt=group.prompt,
                             prompt_token_ids=group.prompt_token_ids, outputs=outputs, finished=finished,
                             num_cached_tokens=group.num_cached_tokens, metrics=group.metrics,
                             prompt_logprobs=prompt_logprobs)

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                           kv_cache_usage=bm.usage, prefix_cache_queries=bm.prefix_cache_queries,
                           prefix_cache_hits=bm.prefix_cache_hits, num_preemptions=self.scheduler.num_preemptions,
                           num_prompt_tokens=self.num_prompt_tokens, num_generation_tokens=self.num_generation_tokens,
                           spec_decode=self.spec.stats if self.spec is not None else None,
                           num_swapped=self.scheduler.num_swapped, num_swap_outs=self.scheduler.num_swap_outs,
                           step_times=self.step_times, **self._lora_stats())

    def _lora_stats(self) -> dict:
        if not self.config.enable_lora:
            return {}
        running, waiting = ({seq.group.lora_request.lora_name for seq in queue if seq.group.lora_request is not None}
                            for queue in (self.scheduler.running, self.scheduler.waiting))
        return {"running_lora_adapters": sorted(running), "waiting_lora_adapters": sorted(waiting),
                "max_lora": self.config.max_loras}

    def snapshot(self) -> dict:
        """Queues and KV pool as plain data, for the dashboard (O(blocks); call between steps)."""
        return {"scheduler": self.scheduler.snapshot(), "kv": self.block_manager.snapshot()}

    def shutdown(self) -> None:
        """Abort every unfinished request and forget the step in flight."""
        self.abort_request(list(self.scheduler.groups))
        self._in_flight = None
        if hasattr(self.runner, "shutdown"):  # tensor parallelism: stop the worker processes
            self.runner.shutdown()
