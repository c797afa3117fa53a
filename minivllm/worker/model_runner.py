"""ModelRunner: loads the model, owns the KV cache and CUDA graphs, and executes one SchedulerOutput.

It is the only layer that turns sequences into tensors; it never decides what to run.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata, set_forward_context
from minivllm.attention.selector import get_attention_backend
from minivllm.attention.torch_backend import fp8_as_bytes
from minivllm.config import EngineConfig
from minivllm.core.interfaces import ModelOutput, SchedulerOutput
from minivllm.core.sequence import SampleLogprobs
from minivllm.distributed import get_tp_size, min_over_ranks
from minivllm.layers.attention import Attention
from minivllm.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from minivllm.lora.manager import LoRAManager
from minivllm.models.loader import ModelSource, load_model, resolve_model
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.draft_model import DraftModelProposer, EarlyExitModel
from minivllm.spec_decode.metadata import build_spec_metadata
from minivllm.spec_decode.rejection_sampler import greedy_verify_host
from minivllm.worker.cuda_graph import CUDAGraphRunner, max_decode_rows
from minivllm.worker.inputs import (ModelInputs, PinnedBufferPool, PreviousSamples, StagingBuffer,
                                   prepare_inputs, prepare_sampling)
from minivllm.worker.kv_cache import allocate_kv_cache, kv_bytes_per_block, kv_cache_budget, resolve_kv_cache_dtype
from minivllm.worker.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs, prompt_logprob_rows
from minivllm.worker.swap import SwapSpace, num_cpu_blocks

logger = logging.getLogger(__name__)

# A step's structured-output mask, or the function that fills it once the forward pass is launched (given
# the device proposer's drafts, {index in the step: ids}, or None).
GrammarBitmask = np.ndarray | Callable[[dict[int, list[int]] | None], np.ndarray | None] | None

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose auto, float32, bfloat16, float16)")
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_num_batched_tokens: int) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        hf = source.hf_config
        self.hf_config = hf
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.vocab_size = hf.vocab_size

        torch.manual_seed(config.seed)
        # Seconds of each start-up phase (the engine and server add theirs; `minivllm serve` logs them).
        self.startup_seconds: dict[str, float] = {}
        if self.device.type == "cuda":   # the CUDA context, timed apart from the weights that follow
            started = time.perf_counter()
            torch.empty(0, device=self.device)
            self.startup_seconds["cuda_init"] = time.perf_counter() - started
        started = time.perf_counter()
        self.model = load_model(source, self.dtype, self.device, config.load_format, config.seed,
                                config.quantization)
        self.model.eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("loaded %s (%.2f GiB of weights, %s, %s) in %.1f s", source.name, weight_bytes / 2**30,
                    self.dtype, self.device, time.perf_counter() - started)
        self.weight_bytes = weight_bytes
        self.startup_seconds["load_weights"] = time.perf_counter() - started

        # Adapter slots before the memory profile, so the KV cache is sized around them.
        self.lora_manager = None if not config.enable_lora else LoRAManager(
            self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras,
            max(max_num_batched_tokens, config.max_num_seqs), self.dtype, self.device)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.spec_config = SpeculativeConfig.from_dict(config.speculative_config)
        self.proposer = self._load_proposer(self.spec_config)
        # A separate draft model's attention layers come after the target's: block i of the pool holds
        # KV in both.
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if self.proposer is not None and not self.proposer.shares_target_kv:
            self.attention_layers += [m for m in self.proposer.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.num_kv_heads = self.attention_layers[0].num_kv_heads  # this rank's, under tensor parallelism
        self.sampler = Sampler()

        self.max_num_batched_tokens = max_num_batched_tokens
        started = time.perf_counter()
        peak = self._profile_peak_memory(max_num_batched_tokens)   # the first forward: kernels compile here
        self.startup_seconds["profile_run"] = time.perf_counter() - started
        started = time.perf_counter()
        budget = kv_cache_budget(self.device, config.gpu_memory_utilization, config.kv_cache_memory, peak)
        per_block = sum(kv_bytes_per_block(1, self.block_size, layer.num_kv_heads, layer.head_dim, self.kv_cache_dtype)
                        for layer in self.attention_layers)
        num_blocks = budget // per_block
        if config.num_gpu_blocks_override is not None:
            num_blocks = min(num_blocks, config.num_gpu_blocks_override)
        num_blocks = min_over_ranks(num_blocks)  # tensor-parallel ranks share one block table
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes")
        self.num_blocks = int(num_blocks)
        self.kv_cache = allocate_kv_cache(self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads,
                                          self.head_dim, self.kv_cache_dtype, self.device)
        self.draft_kv_cache = None
        if len(self.attention_layers) > self.num_layers:
            draft = self.attention_layers[self.num_layers]
            self.draft_kv_cache = allocate_kv_cache(len(self.attention_layers) - self.num_layers, self.num_blocks,
                                                    self.block_size, draft.num_kv_heads, draft.head_dim,
                                                    self.kv_cache_dtype, self.device)
        for i, layer in enumerate(self.attention_layers):
            cache, index = (self.kv_cache, i) if i < self.num_layers else (self.draft_kv_cache, i - self.num_layers)
            layer.k_cache, layer.v_cache = cache[0, index], cache[1, index]
        self.kv_cache_bytes = self.num_blocks * per_block
        self.swap_space = None  # preemption_mode="swap": the CPU blocks swapped sequences' KV lives in
        if config.preemption_mode == "swap":
            caches = [c for c in (self.kv_cache, self.draft_kv_cache) if c is not None]
            self.swap_space = SwapSpace(caches, num_cpu_blocks(config.swap_space, per_block))
        self.num_cpu_blocks = self.swap_space.num_blocks if self.swap_space is not None else 0
        self.kv_budget_bytes = budget
        self.startup_seconds["kv_cache_allocation"] = time.perf_counter() - started
        logger.info("KV cache (%s): %d blocks x %d tokens = %d tokens (%.2f GiB, %.0f%% of the budget)",
                    self.kv_cache_dtype, self.num_blocks, self.block_size, self.num_blocks * self.block_size,
                    self.kv_cache_bytes / 2**30, 100 * self.kv_cache_bytes / max(budget, 1))
        self.graph_runner: CUDAGraphRunner | None = None
        self.stager = StagingBuffer(self.device)
        # Sampling's arrays are copied behind the forward pass; two buffers in turn, so that preparing the next step
        # does not wait for the one on the device.
        self.sampling_stager = StagingBuffer(self.device, num_buffers=2)
        self.host_buffers = PinnedBufferPool()
        self.bitmask_stager = StagingBuffer(self.device)
        self._previous_samples: PreviousSamples | None = None
        # Tensor parallelism: called with (blocks_to_copy, inputs, prompt-logprob rows) to ship each step to
        # the other ranks.
        self.step_broadcaster = None

    def _load_proposer(self, spec_config: SpeculativeConfig | None) -> DraftModelProposer | None:
        """The device proposer of a draft_model speculative config (n-gram proposals come from the host)."""
        if spec_config is None or not spec_config.uses_draft_model:
            return None
        if spec_config.draft_layers is not None:
            return DraftModelProposer(EarlyExitModel(self.model, spec_config.draft_layers), shares_target_kv=True)
        source = resolve_model(spec_config.model, self.config.load_format if self.config.load_format == "dummy"
                               else "auto")
        if source.hf_config.vocab_size != self.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({source.hf_config.vocab_size}) differs from the "
                             f"target's ({self.vocab_size}): a draft must share the target's tokenizer")
        draft = load_model(source, self.dtype, self.device, self.config.load_format, self.config.seed + 1).eval()
        logger.info("draft model %s loaded", source.name)
        return DraftModelProposer(draft, shares_target_kv=False)

    @property
    def num_kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager or self.config.attention_backend == "torch":
            return
        started = time.perf_counter()
        max_blocks = (max_model_len + self.block_size - 1) // self.block_size
        self.graph_runner = CUDAGraphRunner(self.model, max_num_seqs, max_blocks, max_model_len,
                                            self.hf_config.hidden_size, self.dtype, self.device,
                                            min(self.config.cuda_graph_max_tokens, self.max_num_batched_tokens),
                                            self.model.compute_logits if get_tp_size() == 1 else None,
                                            max_decode_rows(max_num_seqs, self.spec_config.num_speculative_tokens
                                                            if self.spec_config else 0))
        self.graph_runner.capture()
        self.startup_seconds["cuda_graph_capture"] = time.perf_counter() - started
        logger.info("CUDA graph capture took %.1f s", self.startup_seconds["cuda_graph_capture"])

    def release_cuda_graphs(self, synchronize: bool = True) -> None:
        """Drop the CUDA graphs and (`synchronize`) let the device finish. Under tensor parallelism NCCL keeps a
        communicator alive while a graph holding its collectives exists: leaving the group before the graphs
        are gone blocks. After a rank was lost the device may never finish, so it is not waited for."""
        self.graph_runner = None
        gc.collect()
        if synchronize and self.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def _profile_peak_memory(self, num_tokens: int) -> int:
        """Run a forward pass of `num_tokens` without a KV cache to measure peak activation memory (CUDA only)."""
        if self.device.type != "cuda":
            return 0
        gc.collect()  # engines dropped but still in reference cycles give their memory back first
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # Sequences of at most 512 tokens, and never longer than the model's positions allow.
        chunk = min(512, getattr(self.hf_config, "max_position_embeddings", 512) or 512)
        lens = [chunk] * (num_tokens // chunk) + ([num_tokens % chunk] if num_tokens % chunk else [])
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).to(self.device)
        metadata = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.from_numpy(starts).to(self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=self.device),
            max_query_len=max(lens), max_seq_len=max(lens),
            query_start_loc_cpu=starts.tolist(), seq_lens_cpu=lens, min_query_len=min(lens))
        input_ids = torch.randint(0, self.vocab_size, (num_tokens,), device=self.device)
        with set_forward_context(metadata):
            hidden = self.model(input_ids, positions)
        self.model.compute_logits(hidden[-min(num_tokens, 256):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        # non_blocking from pageable memory: staged by CUDA without waiting for the stream
        # (torch.tensor(..., device=cuda) would wait for every queued kernel).
        src, dst = torch.tensor(pairs, dtype=torch.int64).t().contiguous().to(self.device, non_blocking=True)
        cache = fp8_as_bytes(self.kv_cache)
        cache[:, :, dst] = cache[:, :, src]

    def _forward(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states, every row's logits when a CUDA graph computed them, else None)."""
        if self.graph_runner is not None and self.graph_runner.can_run(inputs):
            return self.graph_runner.run(inputs)
        with set_forward_context(inputs.metadata):
            return self.model(inputs.input_ids, inputs.positions), None

    def execute(self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask = None) -> ModelOutput:
        return self.execute_async(scheduler_output, grammar_bitmask).result()

    @torch.inference_mode()
    def execute_async(self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask = None,
                      timed: bool = False, timed_end: bool = False) -> PendingModelOutput:
        """Launch one step; the sampled ids stay on the device until `result()` is called, so the host can
        schedule and launch the next step meanwhile (its pending input tokens are read from these).
        `grammar_bitmask`: the structured-output mask of the sampling rows (see SamplingMetadata), or a
        function returning it, called once the forward pass is launched so that the host fills the mask
        while the GPU runs the model; it gets the device proposer's drafts ({index in the step: ids}, or
        None), which decide the masks of verified positions. `timed`: the result knows when the step began on
        the device (`started`, a `StepStart` queued behind its inputs, ahead of its forward pass); `timed_end`:
        and when it ended (`ended`, queued behind the copy of its sampled ids: the device's idle time after it)."""
        # One lookup of the stream per step: each event record or copy that looks it up again builds a
        # Stream object, tens of microseconds a step on the H100's host (spec_decode.py --profile).
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        pending = self._launch(scheduler_output, grammar_bitmask, stream, timed)
        if timed_end:
            pending.ended = StepStart(self.device, stream)
        return pending

    def _launch(self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask,
                stream: torch.cuda.Stream | None = None, timed: bool = False) -> PendingModelOutput:
        if self.swap_space is not None:
            self.swap_space.apply(scheduler_output.blocks_to_swap_out, scheduler_output.blocks_to_swap_in)
        if scheduler_output.blocks_to_copy:
            self._copy_blocks(scheduler_output.blocks_to_copy)
        # Sampling's inputs after the forward's launch, unless a draft model (the drafts' layout) or the other
        # tensor-parallel ranks (the rows to sample) need them first; these need the per-sequence metadata too.
        sampling_first = self.proposer is not None or self.step_broadcaster is not None
        inputs = prepare_inputs(scheduler_output, self.block_size, self.stager, self._previous_samples, stream,
                                self.graph_runner, sequence_tensors=sampling_first)
        # Recorded once the host has prepared the inputs: on a device idle for the host it marks when the step's
        # work could begin, so the idle time from the step before (its `ended`) includes that preparation.
        started = StepStart(self.device, stream) if timed else None
        if self.lora_manager is not None:
            self.lora_manager.set_step(scheduler_output)
        prompt_rows = prompt_logprob_rows(scheduler_output, inputs.metadata.query_start_loc_cpu)
        if sampling_first:
            prepare_sampling(inputs, scheduler_output, self.sampling_stager, stream)
        if self.step_broadcaster is not None:
            self.step_broadcaster(scheduler_output.blocks_to_copy, inputs,
                                  None if prompt_rows is None else prompt_rows[1])
        draft_ids, draft_probs = self._propose(inputs)
        drafts_on_host = None
        if callable(grammar_bitmask) and draft_ids is not None:  # verified positions' masks follow the drafts
            drafts_on_host = self._start_copy_drafts_to_host(draft_ids, stream)
        hidden, all_logits = self._forward(inputs)
        if not sampling_first:
            prepare_sampling(inputs, scheduler_output, self.sampling_stager, stream)
        prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, hidden, prompt_rows)
        if not inputs.sampling_rows:
            self._previous_samples = None
            host_output, ready, buffers = self._start_copy_to_host(None, prompt_logprobs, stream)
            return PendingModelOutput(self, scheduler_output, inputs, None, ready, buffers, prompt_logprobs,
                                      started=started)
        if all_logits is not None:
            logits = all_logits if inputs.samples_every_row else all_logits[inputs.logits_indices]
        else:
            logits = self.model.compute_logits(hidden if inputs.samples_every_row else hidden[inputs.logits_indices])
        metadata = SamplingMetadata.build(inputs.sampling_rows, self.vocab_size, self.device)
        if callable(grammar_bitmask):
            grammar_bitmask = grammar_bitmask(None if drafts_on_host is None else
                                              self._drafts_by_seq(inputs, drafts_on_host))
        if grammar_bitmask is not None:  # pinned: a copy from pageable memory may wait for the forward pass
            (metadata.grammar_bitmask,), = self.bitmask_stager.transfer([(torch.int32, [grammar_bitmask])], stream)
        spec = None if inputs.spec is None else build_spec_metadata(
            inputs.spec, inputs.sampling_rows, draft_ids, draft_probs, logits.shape[1], self.device)
        output = self.sampler(logits, metadata, spec)
        verify_on_host = spec is not None and spec.verify_on_host   # then the rows hold argmaxes, never -1
        self._previous_samples = PreviousSamples(output.token_ids, inputs.sample_row_of_seq,
                                                 spec is not None and not verify_on_host)
        host_output, ready, buffers = self._start_copy_to_host(output, prompt_logprobs, stream)
        return PendingModelOutput(self, scheduler_output, inputs, host_output, ready, buffers, prompt_logprobs,
                                  verify_on_host, started)

    def _propose(self, inputs: ModelInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run the device proposer (drafts written into `inputs.input_ids`); (None, None) without one."""
        if self.proposer is None:
            return None, None
        spec = inputs.spec
        if spec is None or not spec.proposed_on_device:
            self.proposer.catch_up(inputs.input_ids, inputs.positions, inputs.metadata)
            return None, None
        rows_per_step = [SamplingMetadata.build([inputs.sampling_rows[r] for r in spec.row_index_cpu[:, j].tolist()],
                                                self.vocab_size, self.device)
                         for j in range(spec.max_num_drafts)]
        last_hidden_index = spec.draft_positions[:, 0] - 1
        return self.proposer.propose(inputs.input_ids, inputs.positions, inputs.metadata, spec, rows_per_step,
                                     last_hidden_index, spec.last_positions.tolist())

    def _start_copy_drafts_to_host(self, draft_ids: torch.Tensor, stream: torch.cuda.Stream | None = None) -> tuple:
        """Queue the copy of the device proposer's drafts ahead of the target's forward."""
        if self.device.type != "cuda":
            return draft_ids, None, None
        host, buffer = self.host_buffers.copy_to_host(draft_ids)
        ready = torch.cuda.Event()
        ready.record(stream)
        return host, ready, buffer

    def _drafts_by_seq(self, inputs: ModelInputs, drafts_on_host: tuple) -> dict[int, list[int]]:
        """{index in the step: its drafts}, once their copy has landed (the drafts only, not the forward)."""
        draft_ids, ready, buffer = drafts_on_host
        if ready is not None:
            ready.synchronize()
        ids = draft_ids.tolist()
        if buffer is not None:
            self.host_buffers.release([buffer])
        spec = inputs.spec
        return {int(i): ids[n][:int(k)] for n, (i, k) in enumerate(zip(spec.seq_index, spec.num_drafts))}

    def _start_copy_to_host(self, output: SamplerOutput | None, prompt_logprobs: PromptLogprobs | None = None,
                            stream: torch.cuda.Stream | None = None) -> tuple[SamplerOutput | None, torch.cuda.Event | None, list[torch.Tensor]]:
        """Queue the copy of the sampled ids (and logprobs) to pinned host memory right behind the sampler.
        A plain `.tolist()` later would queue its copy behind the *next* step, already launched, and wait
        for that whole step too."""
        if self.device.type != "cuda" or (output is None and prompt_logprobs is None):
            return output, None, []
        buffers = []

        def to_host(tensor):
            if tensor is None:
                return None
            host, buffer = self.host_buffers.copy_to_host(tensor)
            buffers.append(buffer)
            return host
        if prompt_logprobs is not None:
            prompt_logprobs.to_host(to_host)
        host_output = None if output is None else SamplerOutput(*(to_host(t) for t in (
            output.token_ids, output.logprob_token_ids, output.logprobs, output.ranks)))
        ready = torch.cuda.Event()
        ready.record(stream)
        return host_output, ready, buffers

    def _to_model_output(self, scheduler_output: SchedulerOutput, inputs: ModelInputs, output,
                         verify_on_host: bool = False) -> ModelOutput:
        sampled: list[list[int]] = [[] for _ in scheduler_output.seqs]
        if output is None:
            return ModelOutput(sampled_token_ids=sampled)
        token_ids = output.token_ids.tolist()
        if verify_on_host:   # the rows hold the argmaxes (see SpecDecodeMetadata.verify_on_host)
            spec = inputs.spec
            greedy_verify_host(token_ids, spec.row_index_cpu, spec.num_drafts, spec.draft_token_ids)
        per_row_logprobs = self._logprobs_to_host(output, inputs)
        logprobs: list[list[SampleLogprobs]] | None = [[] for _ in scheduler_output.seqs] \
            if per_row_logprobs is not None else None
        row = 0
        for i, num_rows in enumerate(scheduler_output.num_sampling_rows):
            # A verified sequence's rows hold its accepted drafts, one more token, then -1s.
            for _ in range(num_rows):
                if token_ids[row] >= 0:
                    sampled[i].append(token_ids[row])
                    if logprobs is not None:
                        logprobs[i].append(per_row_logprobs[row])
                row += 1
        return ModelOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _logprobs_to_host(output, inputs: ModelInputs) -> list[SampleLogprobs | None] | None:
        if output.logprobs is None:
            return None
        ids, values, ranks = output.logprob_token_ids.tolist(), output.logprobs.tolist(), output.ranks.tolist()
        result: list[SampleLogprobs | None] = []
        for r, row in enumerate(inputs.sampling_rows):
            if row.params.logprobs is None:
                result.append(None)
                continue
            width = 1 + row.params.logprobs
            result.append(SampleLogprobs(token_ids=ids[r][:width], logprobs=values[r][:width], rank=ranks[r]))
        return result


class StepStart:
    """When a step began (or ended) on its device: a CUDA timing event recorded before the step's work (after
    it), which completes once the work queued ahead of it is done (the host clock off the GPU, where a step
    runs as it is launched). From one step's start to the next's is what the step cost the pipeline: its
    device time, plus any time the device then idled waiting for the host; from its end to the next's start
    is that idle time."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        self.event = self.time = None
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record(stream)
        else:
            self.time = time.perf_counter()

    def seconds_until(self, later: StepStart) -> float:
        """Seconds from this start to `later` (both steps must have begun: call it once `later` is read back)."""
        if self.event is not None:
            return self.event.elapsed_time(later.event) / 1e3
        return later.time - self.time


class PendingModelOutput:
    """A launched step whose sampled tokens have not been read back yet."""

    ended: StepStart | None = None

    def __init__(self, runner: ModelRunner, scheduler_output: SchedulerOutput, inputs: ModelInputs,
                 output: SamplerOutput | None, ready: torch.cuda.Event | None,
                 host_buffers: list[torch.Tensor], prompt_logprobs: PromptLogprobs | None = None,
                 verify_on_host: bool = False, started: StepStart | None = None) -> None:
        self.started = started
        self._runner, self._scheduler_output, self._inputs = runner, scheduler_output, inputs
        self._output, self._ready, self._host_buffers = output, ready, host_buffers
        self._prompt_logprobs, self._verify_on_host = prompt_logprobs, verify_on_host

    def done(self) -> bool:
        """Whether `result()` would return without waiting for the device."""
        return self._ready is None or self._ready.query()

    def result(self) -> ModelOutput:
        """Waits for this step's sampled ids to reach the host (the one host sync of a step)."""
        if self._ready is not None:
            self._ready.synchronize()
        model_output = self._runner._to_model_output(self._scheduler_output, self._inputs, self._output,
                                                     self._verify_on_host)
        if self._prompt_logprobs is not None:
            model_output.prompt_logprobs = self._prompt_logprobs.entries()
        self._runner.host_buffers.release(self._host_buffers)  # read into Python lists: reusable now
        self._host_buffers = []
        return model_output
