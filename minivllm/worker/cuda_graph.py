"""CUDA graphs for whole forward passes, replayed from static input buffers.

Two families, sharing one memory pool and one set of buffers:
- decode graphs, one per padded batch size (1, 2, 4, 8, then multiples of 16; past `max_num_seqs` rows for
  verify steps, see `max_decode_rows`): every sequence has one query token, and attention runs the split-K
  decode kernel;
- mixed graphs, one per padded token count (multiples of 64 up to 2,048, then of 256), for any other
  step (prefill, prefill chunks, prefix hits, decodes riding along with them), with the sequence count
  padded to `max_num_seqs`; attention runs the varlen kernel.

Without graphs a forward pass costs the host about 25 ms of Python and launch overhead (measured on an
H100 for Llama-3-8B), twice the GPU time of a 512-token prefill: time to first token would be host-bound.
A replay costs the host well under a millisecond. Padding rows write no KV (slot -1) and their hidden rows are
never read. In a decode graph each padding row is a sequence with no context, which its kernels skip. In a mixed
graph the padding rows are one more sequence (`mixed_seqs` counts it), with no context, attending causally to
itself. Left out of every sequence, their attention output would be whatever the shared memory pool held, NaN
included: the varlen kernels' last key tile of a chunk holds the rows after it, masked to weight 0, and 0 x NaN is
NaN. On an H200 that turned the whole output of 2 in 18 grounded prompts at batch 1 with n-gram speculation into
token 0 (verify steps' decode graphs leave other values in the pool than plain decoding's do). Each family reads
its inputs from views of one device buffer of its own (`GraphInputs`): a decode step's inputs go in with one copy
from a pinned host mirror of the decode graphs' buffer (`stage_decode`, called by `prepare_inputs`), a mixed step's
by a copy per buffer.

A step of short queries (a verify step: 1 + k tokens per sequence) replays a decode graph with one row
per token: row t attends to its sequence's first `positions[t] + 1` tokens (its own KV is written just
before, as in any step), which is exactly causal attention. On SmolLM2-135M at batch 1 (H100) such a
step took 2.0 ms of device time through the 64-token mixed graph against 1.1 ms for a decode step.

Decode graphs of up to `LOGITS_IN_GRAPH_MAX_ROWS` rows also compute the logits (without tensor
parallelism, whose LM head gathers to one rank). Such steps are bound by the host's launches: at batch 1
on SmolLM2 the logits' own launch took 0.09 ms of a verify step's 1.37 ms on the H100's host
(`spec_decode.py --parts steps --trace`). Larger batches are bound by the device, where copying
their logits out of the graph would cost time instead.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata, set_forward_context
from minivllm.kernels.tuning import deferred_under_capture
from minivllm.worker.inputs import MAX_DECODE_ROWS_QUERY_LEN, ModelInputs, StagingBuffer

logger = logging.getLogger(__name__)

LOGITS_IN_GRAPH_MAX_ROWS = 16
# Decode graphs captured for verify steps beyond one row per sequence. With `max_num_seqs` 32, a batch-8 verify
# step of 5 drafts each (48 rows) otherwise ran through the 64-token mixed graph and the varlen kernel; up to 128
# rows costs start-up 6 more graphs there and covers 8 sequences of 15 drafts.
SPEC_DECODE_ROWS = 128


def decode_row_block_tables(metadata: AttentionMetadata) -> torch.Tensor:
    """Each query token's block-table row (its sequence's), for running the step as decode rows."""
    lengths = np.diff(metadata.query_start_loc_cpu)
    if (lengths == lengths[0]).all():   # the usual verify step: k + 1 tokens each, no index to copy
        return metadata.block_tables.repeat_interleave(int(lengths[0]), dim=0)
    index = np.repeat(np.arange(len(lengths)), lengths)
    return metadata.block_tables[torch.from_numpy(index).to(metadata.block_tables.device, non_blocking=True)]


def as_decode_rows(metadata: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
    """The same attention as `metadata`, one decode row per query token: row t's context is its
    sequence's first positions[t] + 1 tokens (what the graph runner's decode-row replay computes)."""
    num_tokens = positions.shape[0]
    return AttentionMetadata(
        slot_mapping=metadata.slot_mapping, seq_lens=(positions + 1).to(torch.int32),
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=positions.device),
        block_tables=decode_row_block_tables(metadata), max_query_len=1, max_seq_len=metadata.max_seq_len,
        query_start_loc_cpu=list(range(num_tokens + 1)), seq_lens_cpu=(positions + 1).tolist())


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes of the decode graphs."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


def max_decode_rows(max_num_seqs: int, num_speculative_tokens: int = 0) -> int:
    """Rows of the largest decode graph: a row per sequence, and with speculation room for verify steps of every
    sequence with its drafts, up to SPEC_DECODE_ROWS (a larger verify step runs through a mixed graph)."""
    return max(max_num_seqs, min(max_num_seqs * (1 + num_speculative_tokens), SPEC_DECODE_ROWS))


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Padded token counts of the mixed graphs: every 64 tokens up to 2,048, then every 256. Padding
    rows cost GEMM work like real ones, and prefill is compute-bound: with a ladder 256 apart above
    1,024, a 1,026-token step would be padded to 1,280 rows, a quarter more work than needed."""
    sizes = list(range(64, min(max_tokens, 2048) + 1, 64)) + list(range(2304, max_tokens + 1, 256))
    return sorted(set(sizes) | ({max_tokens} if max_tokens > 0 else set()))


class GraphInputs:
    """The inputs one family of graphs reads: views of one device buffer. With `mirror`, a pinned host copy laid out
    alike, so that a decode step's inputs arrive in one copy (`copy_rows`); the block tables come last, so that the
    rows of a smaller graph end the copy early. `num_rows`: the most rows of any graph of the family; `num_seqs`:
    the most sequences (a decode graph's rows, a mixed graph's sequences), for the context lengths and block
    tables."""

    def __init__(self, num_rows: int, num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 mirror: bool) -> None:
        layout = {"input_ids": (torch.int64, (num_rows,)), "positions": (torch.int64, (num_rows,)),
                  "slot_mapping": (torch.int64, (num_rows,)), "seq_lens": (torch.int32, (num_seqs,)),
                  "block_tables": (torch.int32, (num_seqs, max_blocks_per_seq))}
        spans, total, align = {}, 0, StagingBuffer.ALIGN_BYTES   # each buffer's bytes, aligned as the staged ones
        for name, (kind, shape) in layout.items():
            nbytes = int(np.prod(shape)) * kind.itemsize
            spans[name] = slice(total, total + nbytes)
            total += -(-nbytes // align) * align
        self.buffer = torch.zeros(total, dtype=torch.uint8, device=device)
        self.mirror = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda") if mirror else None
        self.host = {}   # numpy views of the mirror, by name
        for name, (kind, shape) in layout.items():
            setattr(self, name, self.buffer[spans[name]].view(kind).view(shape))
            if mirror:
                self.host[name] = self.mirror[spans[name]].view(kind).view(shape).numpy()
        self.slot_mapping.fill_(-1)
        if mirror:
            self.host["slot_mapping"][:] = -1
        self._row_bytes = self.block_tables.stride(0) * self.block_tables.element_size()
        self._block_tables_offset = spans["block_tables"].start
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def copy_rows(self, rows: int) -> None:
        """Queue the copy of the mirror into the buffer, through the block tables of the first `rows` sequences."""
        views = self._copies.get(rows)
        if views is None:
            end = self._block_tables_offset + rows * self._row_bytes
            views = self._copies[rows] = (self.buffer[:end], self.mirror[:end])
        views[0].copy_(views[1], non_blocking=True)


class CUDAGraphRunner:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_mixed_tokens: int = 0, compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 max_decode_rows: int = 0) -> None:
        """`compute_logits`: hidden -> logits, captured in the small decode graphs (None: never);
        `max_decode_rows`: rows of the largest decode graph, if more than `max_num_seqs` (verify steps)."""
        self.model = model
        self.compute_logits = compute_logits
        self.sizes = capture_sizes(max(max_num_seqs, max_decode_rows))
        self.mixed_sizes = mixed_capture_sizes(max_mixed_tokens)
        self.max_seqs = max_num_seqs   # real sequences of a mixed graph
        self.mixed_seqs = max_num_seqs + 1   # and one for its padding rows
        self.max_batch = self.sizes[-1]   # rows of the largest decode graph
        self.max_model_len = max_model_len
        n = max(self.max_batch, max(self.mixed_sizes, default=0))
        # The decode graphs read buffers sized for their own rows, so that a decode step's one copy holds its rows:
        # buffers shared with the mixed graphs put three int64 arrays of their 4,096 rows (the default budget) in
        # front of the block tables, a copy of 98 kB even at batch 1.
        self._lay_out_decode_inputs(max_blocks_per_seq, device)
        self.mixed_in = GraphInputs(n, self.mixed_seqs, max_blocks_per_seq, device, mirror=False)
        self._mirror_copied = torch.cuda.Event()
        self.decode_query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(self.mixed_seqs + 1, dtype=torch.int32, device=device)  # mixed steps
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)   # a mixed graph's output
        # Each decode graph's own outputs (hidden states, and logits where it computes them), tensors of the graphs'
        # memory pool that its replays write: no copy into a shared buffer at the end of the step's chain of kernels
        # (Qwen3-30B-A3B single stream 436.2 against 435.4 tok/s on an H200, decode_ab_h200.json `graph_outputs`).
        # A mixed graph copies into `hidden`: one output per token count would hold hundreds of MB.
        self.decode_outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.warmed_up: list[int] = []   # sizes captured a second time, after an eager warm-up
        self._row_views: dict[int, tuple[torch.Tensor, ...]] = {}

    def _lay_out_decode_inputs(self, max_blocks_per_seq: int, device: torch.device) -> None:
        """The decode graphs' inputs (`decode_in`, rows up to `max_batch`), its buffers also as this runner's
        `input_ids`, `positions`, `slot_mapping`, `seq_lens` and `block_tables`."""
        self.decode_in = d = GraphInputs(self.max_batch, self.max_batch, max_blocks_per_seq, device, mirror=True)
        self.input_ids, self.positions, self.slot_mapping = d.input_ids, d.positions, d.slot_mapping
        self.seq_lens, self.block_tables = d.seq_lens, d.block_tables

    def _graph_inputs(self, decode: bool) -> GraphInputs:
        return self.decode_in if decode else self.mixed_in

    def row_views(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, positions, slot_mapping) of a step's first `num_tokens` rows, made once per count: three
        slices cost a step's host tens of microseconds, on the path after a verify step, where the device waits."""
        views = self._row_views.get(num_tokens)
        if views is None:
            views = self._row_views[num_tokens] = (self.input_ids[:num_tokens], self.positions[:num_tokens],
                                                   self.slot_mapping[:num_tokens])
        return views

    def _decode_metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], query_start_loc=self.decode_query_start_loc[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            max_query_len=1, max_seq_len=self.max_model_len)

    def _mixed_metadata(self, num_tokens: int) -> AttentionMetadata:
        # The query-length bound only picks the attention tile shape; any bound >= the real one is exact.
        m = self.mixed_in
        return AttentionMetadata(
            slot_mapping=m.slot_mapping[:num_tokens], query_start_loc=self.query_start_loc,
            seq_lens=m.seq_lens, block_tables=m.block_tables,
            max_query_len=min(num_tokens, self.max_model_len), max_seq_len=self.max_model_len)

    def _logits_in_graph(self, num_tokens: int) -> bool:
        return self.compute_logits is not None and num_tokens <= LOGITS_IN_GRAPH_MAX_ROWS

    def _capture_one(self, num_tokens: int, metadata: AttentionMetadata, decode: bool = False) -> torch.cuda.CUDAGraph:
        """Capture one size straight away; warm it up eagerly and capture again only where a kernel deferred a
        choice to a warm-up (a tile timed per shape, a buffer allocated on first use). A warm-up forward pass
        costs as much host time as a capture and, at thousands of tokens, tens of milliseconds of device time;
        the kernels it would compile or load are loaded during the capture instead (relaxed capture mode)."""
        with_logits = decode and self._logits_in_graph(num_tokens)
        buffers = self._graph_inputs(decode)
        ids, positions = buffers.input_ids[:num_tokens], buffers.positions[:num_tokens]
        with set_forward_context(metadata):
            if decode and self.compute_logits is not None:
                # also for rows whose logits run outside the graph: a quantized LM head's GEMM tunes its tile
                # for this size now, not in the first step that has that many rows
                self.compute_logits(self.hidden[:num_tokens])
            deferred = deferred_under_capture()
            graph = self._record(num_tokens, metadata, decode, with_logits)
            if deferred_under_capture() != deferred:
                self.warmed_up.append(num_tokens)
                self.hidden[:num_tokens] = self.model(ids, positions)
                # The first graph is dropped only now: while no graph uses the shared pool, torch frees it, and a
                # capture into a freed pool fails.
                graph = self._record(num_tokens, metadata, decode, with_logits)
        return graph

    def _record(self, num_tokens: int, metadata: AttentionMetadata, decode: bool,
                with_logits: bool) -> torch.cuda.CUDAGraph:
        # What the backend derived for an earlier pass is recomputed inside the graph, or replays would reuse
        # that pass's values.
        metadata.backend_state.clear()
        graph = torch.cuda.CUDAGraph()
        buffers = self._graph_inputs(decode)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="relaxed"):
            hidden = self.model(buffers.input_ids[:num_tokens], buffers.positions[:num_tokens])
            if decode:
                self.decode_outputs[num_tokens] = (hidden, self.compute_logits(hidden) if with_logits else None)
            else:
                self.hidden[:num_tokens] = hidden
        return graph

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so smaller graphs reuse the largest one's memory pool. While capturing, every
        # sequence is a padding one: no query tokens, no context, nothing written.
        self.pool = torch.cuda.graph_pool_handle()
        self.mixed_in.seq_lens.zero_()
        self.seq_lens.zero_()
        for num_tokens in reversed(self.mixed_sizes):
            self.mixed_graphs[num_tokens] = self._capture_one(num_tokens, self._mixed_metadata(num_tokens))
        for batch in reversed(self.sizes):
            self.seq_lens[:batch] = 1
            self.graphs[batch] = self._capture_one(batch, self._decode_metadata(batch), decode=True)
        self.seq_lens.zero_()
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s and mixed steps of up to %d tokens (%d graphs); "
                    "warmed up first: %s", self.sizes, max(self.mixed_sizes, default=0), len(self.mixed_sizes),
                    self.warmed_up or "none")

    def decode_size(self, num_seqs: int, num_tokens: int, max_query_len: int) -> int | None:
        """The decode graph (its padded row count) that replays a step of these shapes, one row per token, or None
        (a mixed graph or no graph)."""
        if num_seqs > self.max_seqs or num_tokens > self.max_batch or max_query_len > MAX_DECODE_ROWS_QUERY_LEN:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def stage_decode(self, padded: int, token_ids, positions, slot_mapping, seq_lens, block_tables,
                     stream: torch.cuda.Stream | None = None) -> None:
        """Queue the copy of a decode step's inputs into the graphs' buffers, one row per token (host arrays:
        `block_tables` [rows, width]), rows up to `padded` as padding (no KV written, no context). One host-to-device
        copy replaces a copy per buffer before the replay; `run` then only replays. The mirror is rewritten only
        once the previous copy from it is done."""
        host, rows = self.decode_in.host, len(token_ids)
        self._mirror_copied.synchronize()
        host["input_ids"][:rows] = token_ids
        host["positions"][:rows] = positions
        host["slot_mapping"][:rows] = slot_mapping
        host["slot_mapping"][rows:padded] = -1
        host["seq_lens"][:rows] = seq_lens
        host["seq_lens"][rows:padded] = 0
        host["block_tables"][:rows, :block_tables.shape[1]] = block_tables
        self.decode_in.copy_rows(padded)
        self._mirror_copied.record(stream)

    def _as_decode_rows(self, inputs: ModelInputs) -> bool:
        meta = inputs.metadata
        return (not meta.is_decode_only and meta.max_query_len <= MAX_DECODE_ROWS_QUERY_LEN
                and meta.query_start_loc_cpu is not None and inputs.input_ids.shape[0] <= self.max_batch)

    def can_run(self, inputs: ModelInputs) -> bool:
        meta = inputs.metadata
        if meta.num_seqs > self.max_seqs:
            return False
        if meta.is_decode_only or self._as_decode_rows(inputs):
            return True
        return bool(self.mixed_sizes) and inputs.input_ids.shape[0] <= self.mixed_sizes[-1]

    def _replay_decode(self, padded: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.graphs[padded].replay()
        hidden, logits = self.decode_outputs[padded]
        return hidden[:num_tokens], None if logits is None else logits[:num_tokens]

    def run(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the step's graph: (hidden states, the logits of every row if the graph computed them)."""
        meta = inputs.metadata
        batch, num_tokens = meta.num_seqs, inputs.input_ids.shape[0]
        if inputs.staged is not None and inputs.staged[0] is self:   # `stage_decode` copied the inputs in
            return self._replay_decode(inputs.staged[1], num_tokens)
        rows = self._as_decode_rows(inputs)
        decode = meta.is_decode_only or rows
        padded = next(s for s in (self.sizes if decode else self.mixed_sizes) if s >= num_tokens)
        buffers = self._graph_inputs(decode)
        buffers.input_ids[:num_tokens].copy_(inputs.input_ids, non_blocking=True)
        buffers.positions[:num_tokens].copy_(inputs.positions, non_blocking=True)
        buffers.slot_mapping[:num_tokens].copy_(meta.slot_mapping, non_blocking=True)
        seq_lens_d, block_tables_d = buffers.seq_lens, buffers.block_tables
        width = meta.block_tables.shape[1]
        if rows:   # one decode row per token (see the module docstring)
            if inputs.decode_rows is not None:   # staged by prepare_inputs
                seq_lens, block_tables = inputs.decode_rows
                seq_lens_d[:num_tokens].copy_(seq_lens, non_blocking=True)
                block_tables_d[:num_tokens, :width].copy_(block_tables, non_blocking=True)
            else:
                block_tables_d[:num_tokens, :width] = decode_row_block_tables(meta)
                seq_lens_d[:num_tokens] = inputs.positions + 1
            batch = num_tokens
        else:
            seq_lens_d[:batch].copy_(meta.seq_lens, non_blocking=True)
            block_tables_d[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        if padded > num_tokens:
            buffers.slot_mapping[num_tokens:padded].fill_(-1)
        if decode:
            if padded > batch:
                seq_lens_d[batch:padded].zero_()
            return self._replay_decode(padded, num_tokens)
        # Sequence `batch` owns the padding rows, with no context; the ones after it own nothing.
        self.query_start_loc[:batch + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.query_start_loc[batch + 1:].fill_(padded)
        seq_lens_d[batch:batch + 1].fill_(padded - num_tokens)
        seq_lens_d[batch + 1:].zero_()
        self.mixed_graphs[padded].replay()
        return self.hidden[:num_tokens], None
