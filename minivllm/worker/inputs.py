"""Flatten one SchedulerOutput into the model's input tensors and attention metadata.

Vectorised with numpy over tokens; the only Python loop is over scheduled sequences. Two parts: the forward
pass's inputs (`prepare_inputs`) and sampling's (`prepare_sampling`, built once the forward is launched). Each
part's arrays (int64 and int32) travel in one host-to-device copy from a persistent pinned staging buffer (pinning
fresh memory every step costs more than the copy itself); a step that replays a decode graph writes its forward
inputs into the graph's own pinned mirror instead (worker/cuda_graph.py `stage_decode`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.core.interfaces import SchedulerOutput
from minivllm.core.sequence import Sequence
from minivllm.layers.sampler import SamplingRow


class SequenceSamplingRow(SamplingRow):
    """A SamplingRow that reads its token lists from the sequence only when the sampler asks (penalties),
    instead of copying both lists for every row of every step."""

    def __init__(self, seq: Sequence, sample_index: int, step_drafts: list[int] = (), num_drafts_before: int = 0
                 ) -> None:
        """`step_drafts`: the sequence's drafts in this step; `num_drafts_before`: how many of them precede this
        row's position (a verified position sees them as output). A verify step makes a row per position, so the
        list is shared, not sliced per row."""
        self.seq, self.params, self.sample_index = seq, seq.sampling_params, sample_index
        self.step_drafts, self.num_drafts_before = step_drafts, num_drafts_before

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        if not self.num_drafts_before:
            return self.seq.output_token_ids
        return self.seq.output_token_ids + list(self.step_drafts[:self.num_drafts_before])

    @property
    def num_output_tokens(self) -> int:
        # Tokens before this row's sample: the appended ones plus any still in flight (the scheduler
        # counted this step's sample and drafts as pending already), plus the drafts before this position.
        return (self.seq.num_output_tokens + self.seq.num_pending_tokens - 1 - len(self.step_drafts)
                + self.num_drafts_before)


# Longest query that runs as decode rows: each row reads its whole context, so long queries (prefill
# chunks) belong to the varlen kernel, which reads it once per tile of queries.
MAX_DECODE_ROWS_QUERY_LEN = 16


@dataclass
class PreviousSamples:
    """The sampled ids of the step in flight, on the device, and which row holds each sequence's own token
    (a verifying sequence's last row: its token if every draft is accepted; otherwise -1, or an argmax that
    the host's verification drops, and the step reading it is discarded)."""
    token_ids: torch.Tensor
    row_of_seq: dict[int, int]
    verified: bool = False   # the step verified drafts on the device: its rows may hold -1


@dataclass
class SpecLayout:
    """Where a step's draft tokens sit: N speculating sequences with up to K drafts each (host arrays,
    then device copies). Drafts marked -1 are proposed on the device and written into `input_ids`."""
    seq_index: np.ndarray          # [N] index of each speculating sequence in the SchedulerOutput
    num_drafts: np.ndarray         # [N]
    draft_token_ids: np.ndarray    # [N, K] -1 = proposed on the device (and past num_drafts)
    row_index_cpu: np.ndarray      # [N, K + 1]
    last_positions: np.ndarray     # [N] position of each one's last known token (the one before its drafts)
    # Device copies, None when `verified_on_host`:
    row_index: torch.Tensor | None        # [N, K + 1] sampling rows of the verified positions
    draft_positions: torch.Tensor | None  # [N, K] flat input rows holding the drafts (pads repeat the last)
    num_drafts_d: torch.Tensor | None     # [N]
    draft_token_ids_d: torch.Tensor | None  # [N, K]
    verified_on_host: bool = False   # every speculating row greedy, every draft from the host

    @property
    def max_num_drafts(self) -> int:
        return self.draft_token_ids.shape[1]

    @property
    def proposed_on_device(self) -> bool:
        return bool((self.draft_token_ids[:, 0] < 0).any())


@dataclass
class ModelInputs:
    input_ids: torch.Tensor       # [T] int64 (pending tokens filled in on the device)
    positions: torch.Tensor       # [T] int64
    metadata: AttentionMetadata
    # Short queries (a verify step) as one decode row per token, staged with the rest: each token's
    # context length (its position + 1) and its sequence's block-table row (see worker/cuda_graph.py).
    decode_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # (graph runner, padded rows) when the step's inputs were staged into that runner's decode-graph buffers
    staged: tuple | None = None
    # Sampling, from `prepare_sampling` (tensor-parallel ranks get logits_indices only):
    logits_indices: torch.Tensor | None = None  # [S] rows of the hidden states to sample from (repeated for forks)
    sampling_rows: list[SamplingRow] = field(default_factory=list)
    sample_row_of_seq: dict[int, int] = field(default_factory=dict)  # seq_id -> the row of its own next token
    spec: SpecLayout | None = None     # draft tokens to verify, if any sequence speculates
    samples_every_row: bool = False    # logits_indices is 0, 1, ..., T - 1 (plain decode, verify steps)


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.uint8: np.uint8}


class StagingBuffer:
    """Packs host arrays of several dtypes into one pinned byte buffer and copies them to the device at once.

    Each array starts on a 16-byte boundary: Triton specialises kernels on whether pointers are 16-byte
    aligned, so an array landing at an odd offset in one step would recompile the kernels reading it
    mid-run (a fresh compile costs a step ~200 ms). One copy per transfer rather than one per dtype: at batch 1
    every host-side torch call (a copy, an event, a view) is a visible share of a step (spec_decode.py
    --profile), so the device tensors come from one dtype view and one split per group.

    The copy is asynchronous; before a buffer is overwritten we wait on the event recorded after its previous
    copy, so a copy still in flight never reads half-new data. With `num_buffers` > 1 the buffers take turns: a
    copy queued behind a forward pass is then not waited for by the next step's preparation.
    """

    ALIGN_BYTES = 16

    def __init__(self, device: torch.device, num_buffers: int = 1) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        # Pinned buffers used in turn, each with the event recorded after its last copy.
        self.buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(num_buffers)]
        self.events = [torch.cuda.Event() for _ in range(num_buffers)] if self.pinned else []
        self.turn = 0

    def transfer(self, groups: list[tuple[torch.dtype, list[np.ndarray]]], stream=None) -> list[list[torch.Tensor]]:
        """[(dtype, host arrays)] -> per group, the arrays as device tensors of that dtype (shapes kept).
        `stream`: the stream the copy is queued on (the current one if None; passing it saves a lookup)."""
        plan, total = [], 0   # per group: (dtype, numpy dtype, arrays, first byte, end byte, element counts)
        for dtype, arrays in groups:
            np_dtype = _NUMPY_DTYPES[dtype]
            itemsize = np.dtype(np_dtype).itemsize
            align = self.ALIGN_BYTES // itemsize
            arrays = [np.asarray(a, dtype=np_dtype) for a in arrays]
            pieces = []   # element counts: each array, then the padding to the next boundary
            for a in arrays:
                pieces += [a.size, -a.size % align]
            end = total + sum(pieces) * itemsize
            plan.append((dtype, np_dtype, arrays, total, end, pieces))
            total = end
        if self.pinned:
            turn = self.turn = (self.turn + 1) % len(self.buffers)
            self.events[turn].synchronize()
            if self.buffers[turn].numel() < total:
                self.buffers[turn] = torch.empty(max(total, 2 * self.buffers[turn].numel()), dtype=torch.uint8,
                                                 pin_memory=True)
            host = self.buffers[turn][:total]
        else:
            host = torch.empty(total, dtype=torch.uint8)   # the returned CPU tensors alias it: fresh each step
        host_bytes = host.numpy()
        for _, np_dtype, arrays, start, end, pieces in plan:
            region = host_bytes[start:end].view(np_dtype)
            offset = 0
            for a, n, pad in zip(arrays, pieces[::2], pieces[1::2]):
                region[offset:offset + n] = a.ravel()
                offset += n + pad
        if self.pinned:
            flat = host.to(self.device, non_blocking=True)
            self.events[turn].record(stream)
        else:
            flat = host
        out = []
        for dtype, _, arrays, start, end, pieces in plan:
            region = flat[start:end].view(dtype)
            parts = region.split(pieces)[::2]
            out.append([t if a.ndim == 1 else t.view(a.shape) for t, a in zip(parts, arrays)])
        return out


class PinnedBufferPool:
    """Pinned host buffers for the device-to-host copies of each step's sampled ids and logprobs,
    reused across steps. Pinning fresh memory for every step's (differently sized) outputs costs 1 to
    20 ms of host time per new size on the H100 host, while the GPU waits."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []  # uint8 base buffers

    def copy_to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue a non-blocking copy of `tensor` into a pooled buffer; returns (host view, its buffer)."""
        nbytes = tensor.numel() * tensor.element_size()
        for i, base in enumerate(self._free):
            if base.numel() >= nbytes:
                buffer = self._free.pop(i)
                break
        else:
            buffer = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
        host = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        return host, buffer

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Give buffers back once their contents have been read on the host."""
        self._free.extend(buffers)


def prepare_inputs(scheduler_output: SchedulerOutput, block_size: int, stager: StagingBuffer,
                   previous_samples: PreviousSamples | None = None, stream=None, graph=None,
                   sequence_tensors: bool = True) -> ModelInputs:
    """The forward pass's inputs (`prepare_sampling` adds what sampling needs). `previous_samples`: the step still
    in flight, whose sampled ids fill pending input positions; `stream`: the stream the step runs on (None: the
    current one); `graph`: the CUDA graph runner, which takes a step one of its decode graphs replays straight into
    that graph's buffers (worker/cuda_graph.py `stage_decode`); `sequence_tensors`: whether such a step of several
    rows a sequence (a verify step) needs its per-sequence metadata on the device too, for what runs outside the
    graph (a draft model, tensor-parallel ranks). Without, that metadata stays on the host: after a verify step
    the device idles until this step is launched, and that copy was a third of the host's preparation."""
    seqs = scheduler_output.seqs
    scheduled = scheduler_output.num_scheduled_tokens
    if len(seqs) == 1 and graph is not None and (scheduled[0] == 1 or not sequence_tensors):
        padded = graph.decode_size(1, scheduled[0], scheduled[0])
        if padded is not None and not (previous_samples is not None and previous_samples.verified):
            return _prepare_one_sequence(scheduler_output, block_size, previous_samples, stream, graph, padded)
    num_scheduled = np.asarray(scheduled, dtype=np.int64)
    starts = np.asarray(scheduler_output.num_computed_tokens or [s.num_computed_tokens for s in seqs],
                        dtype=np.int64)
    seq_lens = starts + num_scheduled
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    query_start_loc[1:] = list(itertools.accumulate(scheduled))   # np.cumsum into a view costs more at a few rows
    num_tokens = int(query_start_loc[-1])

    spec_tokens = scheduler_output.spec_token_ids or [[]] * len(seqs)
    token_ids: list[int] = []
    fill_positions: list[int] = []  # flat input rows whose token is still being sampled
    fill_rows: list[int] = []       # ... and its row in the in-flight step's sampled ids
    for seq, start, n, drafts in zip(seqs, starts.tolist(), num_scheduled.tolist(), spec_tokens):
        n -= len(drafts)
        known = seq.token_ids[start:start + n]
        token_ids.extend(known)
        if len(known) < n:
            assert len(known) == n - 1 and previous_samples is not None, "only the newest token can be pending"
            fill_positions.append(len(token_ids))
            fill_rows.append(previous_samples.row_of_seq[seq.seq_id])
            token_ids.append(0)
        if drafts and min(drafts) < 0:   # device-proposed drafts (-1) are written in later
            drafts = [max(t, 0) for t in drafts]
        token_ids.extend(drafts)

    max_blocks = max(len(s.block_table) for s in seqs)
    block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for i, seq in enumerate(seqs):
        block_tables[i, :len(seq.block_table)] = seq.block_table

    # Per-token sequence index and position, without a Python loop over tokens.
    seq_index = np.repeat(np.arange(len(seqs)), num_scheduled)
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - starts, num_scheduled)
    slot_mapping = (block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)

    max_query_len = max(scheduled)
    decode_only = max_query_len == 1
    padded = None if graph is None else graph.decode_size(len(seqs), num_tokens, max_query_len)
    if padded is not None:   # a decode graph's step: its inputs go straight into the graph's buffers
        graph.stage_decode(padded, token_ids, positions, slot_mapping, seq_lens if decode_only else positions + 1,
                           block_tables if decode_only else block_tables[seq_index], stream)
    one_fill = len(fill_positions) == 1 and not previous_samples.verified
    int64_arrays = [] if one_fill or not fill_positions else [np.asarray(fill_positions, dtype=np.int64),
                                                               np.asarray(fill_rows, dtype=np.int64)]
    if padded is None:
        int64_arrays += [np.asarray(token_ids, dtype=np.int64), positions, slot_mapping]
    # Per-sequence metadata for what runs outside the graph (a draft model's forward, tensor-parallel ranks). A
    # decode step's is the graph's own rows.
    on_host = padded is not None and not decode_only and not sequence_tensors
    sequence_arrays = None if padded is not None and decode_only else [
        query_start_loc.astype(np.int32), seq_lens.astype(np.int32), block_tables]
    int32_arrays = [] if padded is not None and (decode_only or on_host) else list(sequence_arrays)
    short_queries = 1 < max_query_len <= MAX_DECODE_ROWS_QUERY_LEN
    if short_queries and padded is None:
        int32_arrays += [(positions + 1).astype(np.int32), block_tables[seq_index]]
    groups = [(dtype, arrays) for dtype, arrays in ((torch.int64, int64_arrays), (torch.int32, int32_arrays)) if arrays]
    sent = stager.transfer(groups, stream) if groups else []
    int64_d = sent.pop(0) if int64_arrays else []
    int32_d = sent.pop(0) if int32_arrays else []
    decode_rows = None
    if padded is None:
        input_ids_d, positions_d, slot_mapping_d = int64_d[-3:]
        query_start_loc_d, seq_lens_d, block_tables_d, *rows = int32_d
        decode_rows = tuple(rows) if rows else None
    else:
        input_ids_d, positions_d, slot_mapping_d = graph.row_views(num_tokens)
        if decode_only:
            query_start_loc_d = graph.decode_query_start_loc[:len(seqs) + 1]
            seq_lens_d, block_tables_d = graph.seq_lens[:len(seqs)], graph.block_tables[:len(seqs), :max_blocks]
        elif on_host:   # nothing on the device reads them: a use there fails instead of reading stale rows
            query_start_loc_d, seq_lens_d, block_tables_d = (torch.from_numpy(a) for a in sequence_arrays)
        else:
            query_start_loc_d, seq_lens_d, block_tables_d = int32_d
    if one_fill:
        # Batch 1: one slice copy, a launch fewer than gather + scatter (the host is a step's bottleneck here).
        position, row = fill_positions[0], fill_rows[0]
        input_ids_d[position:position + 1].copy_(previous_samples.token_ids[row:row + 1], non_blocking=True)
    elif fill_positions:
        fill_positions_d, fill_rows_d = int64_d[:2]
        filled = previous_samples.token_ids[fill_rows_d]
        # A rejected position's -1 feeds only a step that is discarded: keep it a valid id.
        input_ids_d[fill_positions_d] = filled.clamp_min(0) if previous_samples.verified else filled
    seq_lens_cpu = seq_lens.tolist()
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping_d,
        query_start_loc=query_start_loc_d,
        seq_lens=seq_lens_d,
        block_tables=block_tables_d,
        max_query_len=max_query_len,
        max_seq_len=max(seq_lens_cpu),
        query_start_loc_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens_cpu,
        min_query_len=min(scheduled),
    )
    return ModelInputs(input_ids=input_ids_d, positions=positions_d, metadata=metadata, decode_rows=decode_rows,
                       staged=None if padded is None else (graph, padded))


def _prepare_one_sequence(scheduler_output: SchedulerOutput, block_size: int, previous_samples: PreviousSamples | None,
                          stream, graph, padded: int) -> ModelInputs:
    """`prepare_inputs` for a step of one sequence that a decode graph replays (batch 1: a plain step, or a verify
    step one row per token), its per-sequence metadata kept on the host. The same inputs, from Python lists and a
    few numpy calls: right after a verify step the device idles while the host prepares this step, and at a
    handful of rows the general path's numpy calls were most of that preparation."""
    seq = scheduler_output.seqs[0]
    n = scheduler_output.num_scheduled_tokens[0]
    start = scheduler_output.num_computed_tokens[0] if scheduler_output.num_computed_tokens else seq.num_computed_tokens
    end = start + n
    drafts = scheduler_output.spec_token_ids[0] if scheduler_output.spec_token_ids else []
    token_ids = seq.token_ids[start:end - len(drafts)]
    fill = len(token_ids) < n - len(drafts)   # the newest token, still being sampled
    if fill:
        assert len(token_ids) == n - len(drafts) - 1 and previous_samples is not None, \
            "only the newest token can be pending"
        token_ids.append(0)
    token_ids += drafts if not drafts or min(drafts) >= 0 else [max(t, 0) for t in drafts]
    table = seq.block_table
    slots = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    block_tables = np.array(table, dtype=np.int32)[None]   # one row, broadcast over the step's rows
    positions = np.arange(start, end, dtype=np.int64)
    graph.stage_decode(padded, token_ids, positions, slots, end if n == 1 else positions + 1, block_tables, stream)
    input_ids_d, positions_d, slot_mapping_d = graph.row_views(n)
    if n == 1:
        query_start_loc_d = graph.decode_query_start_loc[:2]
        seq_lens_d, block_tables_d = graph.seq_lens[:1], graph.block_tables[:1, :len(table)]
    else:   # nothing on the device reads them (see `prepare_inputs`)
        query_start_loc_d = torch.from_numpy(np.array((0, n), dtype=np.int32))
        seq_lens_d, block_tables_d = torch.from_numpy(np.array((end,), dtype=np.int32)), torch.from_numpy(block_tables)
    if fill:
        row, position = previous_samples.row_of_seq[seq.seq_id], len(token_ids) - len(drafts) - 1
        input_ids_d[position:position + 1].copy_(previous_samples.token_ids[row:row + 1], non_blocking=True)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping_d, query_start_loc=query_start_loc_d, seq_lens=seq_lens_d,
        block_tables=block_tables_d, max_query_len=n, max_seq_len=end, query_start_loc_cpu=[0, n],
        seq_lens_cpu=[end], min_query_len=n)
    return ModelInputs(input_ids=input_ids_d, positions=positions_d, metadata=metadata, staged=(graph, padded))


_ROW_RANGES: dict[torch.device, torch.Tensor] = {}


def row_range(n: int, device: torch.device) -> torch.Tensor:
    """0, 1, ..., n - 1 as int64 on `device`: a view of one tensor kept per device. A decode step samples every row,
    and staging its indices cost the host a transfer (the step's second copy) that nothing else needed."""
    kept = _ROW_RANGES.get(device)
    if kept is None or kept.numel() < n:
        kept = _ROW_RANGES[device] = torch.arange(max(n, 256), dtype=torch.int64, device=device)
    return kept[:n]


def prepare_sampling(inputs: ModelInputs, scheduler_output: SchedulerOutput, stager: StagingBuffer,
                     stream=None) -> None:
    """Fill in `inputs`' sampling rows, the hidden rows they sample and the drafts' layout. Apart from the forward
    inputs, so that the runner can launch the forward first: after a verify step the device idles until then.
    `stager`: not the one `prepare_inputs` used (its copy may queue behind the forward)."""
    seqs = scheduler_output.seqs
    query_start_loc = inputs.metadata.query_start_loc_cpu
    num_tokens = query_start_loc[-1]
    spec_tokens = scheduler_output.spec_token_ids or [[]] * len(seqs)
    logits_indices: list[int] = []
    rows: list[SamplingRow] = []
    sample_row_of_seq: dict[int, int] = {}
    spec_rows: list[list[int]] = []  # per speculating sequence: the sampling rows of its verified positions
    for i, (seq, num_samples, drafts) in enumerate(zip(seqs, scheduler_output.num_samples, spec_tokens)):
        if num_samples:
            sample_row_of_seq[seq.seq_id] = len(rows) + len(drafts)
        end = query_start_loc[i + 1]
        if drafts:
            # Every draft position and the one after the last draft are scored: num_drafts + 1 rows.
            spec_rows.append(list(range(len(rows), len(rows) + len(drafts) + 1)))
            for j in range(len(drafts) + 1):
                logits_indices.append(end - 1 - len(drafts) + j)
                rows.append(SequenceSamplingRow(seq, seq.index, drafts, j))
            continue
        for k in range(num_samples):
            logits_indices.append(end - 1)
            # A forking sequence samples for its future siblings too: sample k becomes sibling k.
            rows.append(SequenceSamplingRow(seq, sample_index=seq.index + k))
    spec_host = _spec_layout_arrays(spec_tokens, spec_rows, query_start_loc) if spec_rows else None
    # Greedy rows verifying drafts proposed on the host are verified on the host once read back (the sampler leaves
    # their argmaxes): the drafts' layout stays on the host.
    on_host = spec_host is not None and min(min(d) for d in spec_tokens if d) >= 0 and all(
        rows[r[0]].params.greedy for r in spec_rows)
    inputs.samples_every_row = len(logits_indices) == num_tokens and logits_indices == list(range(num_tokens))
    staged_spec = spec_host[1:] if spec_host is not None and not on_host else ()
    if inputs.samples_every_row and not staged_spec:   # no copy for its indices
        logits_indices_d, spec_d = row_range(num_tokens, stager.device), []
    else:
        arrays = [np.asarray(logits_indices, dtype=np.int64), *staged_spec]
        (logits_indices_d, *spec_d), = stager.transfer([(torch.int64, arrays)], stream)
    spec_d = spec_d or [None] * 4
    inputs.logits_indices, inputs.sampling_rows, inputs.sample_row_of_seq = logits_indices_d, rows, sample_row_of_seq
    if spec_host is not None:
        # each speculating sequence's last known token, the one before its drafts
        last_positions = (np.asarray(inputs.metadata.seq_lens_cpu)[spec_host[0]] - spec_host[1] - 1)
        inputs.spec = SpecLayout(
            seq_index=spec_host[0], num_drafts=spec_host[1], draft_token_ids=spec_host[2], row_index_cpu=spec_host[3],
            last_positions=last_positions, num_drafts_d=spec_d[0], draft_token_ids_d=spec_d[1], row_index=spec_d[2],
            draft_positions=spec_d[3], verified_on_host=on_host)


def _spec_layout_arrays(spec_tokens: list[list[int]], spec_rows: list[list[int]], query_start_loc: list[int]
                        ) -> tuple[np.ndarray, ...]:
    """(seq_index, num_drafts, draft ids, row index, draft positions), padded to the longest draft list (built as
    lists: at batch 1 a numpy call per array cost more than the lists)."""
    seq_index = [i for i, drafts in enumerate(spec_tokens) if drafts]
    num_drafts = [len(spec_tokens[i]) for i in seq_index]
    k = max(num_drafts)
    draft_ids, row_index, draft_positions = [], [], []
    for i, d, rows in zip(seq_index, num_drafts, spec_rows):
        pad = k - d
        draft_ids.append(spec_tokens[i] + [-1] * pad)
        row_index.append(rows + rows[-1:] * pad)
        first = query_start_loc[i + 1] - d
        draft_positions.append(list(range(first, first + d)) + [first + d - 1] * pad)
    return tuple(np.array(a, dtype=np.int64) for a in (seq_index, num_drafts, draft_ids, row_index, draft_positions))
