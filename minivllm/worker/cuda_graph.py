"""CUDA graphs for decode steps: captured once per padded batch size, replayed from static buffers.

A decode step launches a few hundred small kernels; replaying a graph removes their launch cost. Each
graph reads its inputs from buffers owned here, so a replay only needs the new values copied in.
"""
from __future__ import annotations

import logging

import torch

from minivllm.attention.metadata import AttentionMetadata, set_forward_context
from minivllm.worker.inputs import ModelInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    sizes = sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})
    return sizes


class CUDAGraphRunner:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            max_query_len=1, max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so smaller graphs reuse the largest one's memory pool.
        for batch in reversed(self.sizes):
            self.seq_lens[:batch] = 1
            metadata = self._metadata(batch)
            with set_forward_context(metadata):
                self.hidden[:batch] = self.model(self.input_ids[:batch], self.positions[:batch])  # warm-up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.hidden[:batch] = self.model(self.input_ids[:batch], self.positions[:batch])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        self.seq_lens.zero_()
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, inputs: ModelInputs) -> bool:
        return inputs.metadata.is_decode_only and inputs.metadata.num_seqs <= self.max_batch

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        batch = inputs.metadata.num_seqs
        padded = next(s for s in self.sizes if s >= batch)
        meta = inputs.metadata
        self.input_ids[:batch].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:batch].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        if padded > batch:
            # Padding rows write nowhere and attend to nothing.
            self.slot_mapping[batch:padded].fill_(-1)
            self.seq_lens[batch:padded].zero_()
        self.graphs[padded].replay()
        return self.hidden[:batch]
