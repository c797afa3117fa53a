"""Triton paged attention: the fast path on CUDA (and, under TRITON_INTERPRET=1, on CPU in tests).

Imported only when the 'triton' backend is selected, so the CPU path never needs Triton. Dispatch:
decode-only batches (every query length 1) go to the split-K decode kernel; anything else (prefill,
chunked prefill, prefix-cache hits, decodes mixed with prefill chunks) goes to the varlen kernel, which
on Hopper hands the sequences with long query runs to the Gluon kernel; this backend builds that
kernel's query-tile plan once per step.
Must agree with `TorchAttentionBackend` on any valid metadata.
"""
from __future__ import annotations

import torch

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.metadata import AttentionMetadata

try:
    from minivllm.kernels import paged_decode_attention, paged_prefill_attention, prefill_attention_sm90, write_kv
except ModuleNotFoundError as error:  # pragma: no cover - depends on the machine
    if error.name != "triton" and not (error.name or "").startswith("triton."):
        raise
    raise ImportError("the 'triton' attention backend needs the triton package "
                      "(pip install triton, or choose the 'torch' backend)") from error


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, decode_partition_size: int | None = None):
        """`decode_partition_size`: None picks split-K from the shapes; a power of two >= 16 forces
        that many tokens per partition (a value past the block table's reach disables the split)."""
        self.decode_partition_size = decode_partition_size

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0, sliding_window: int | None = None,
               logits_soft_cap: float | None = None, key: torch.Tensor | None = None,
               value: torch.Tensor | None = None) -> torch.Tensor:
        # Decode-only with one row per sequence: row i is sequence i's query (query_start_loc = arange).
        if metadata.is_decode_only and query.shape[0] == metadata.num_seqs:
            return paged_decode_attention(query, k_cache, v_cache, metadata.block_tables,
                                          metadata.seq_lens, scale,
                                          partition_size=self.decode_partition_size,
                                          k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap)
        return paged_prefill_attention(query, k_cache, v_cache, metadata.query_start_loc,
                                       metadata.seq_lens, metadata.block_tables, scale,
                                       max_query_len=metadata.max_query_len,
                                       min_query_len=metadata.min_query_len,
                                       k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
                                       logits_soft_cap=logits_soft_cap, key=key, value=value,
                                       query_tile_plan=self._query_tile_plan(query, key, value, k_cache,
                                                                             v_cache, metadata))

    @staticmethod
    def _query_tile_plan(query, key, value, k_cache, v_cache, metadata: AttentionMetadata):
        """The Hopper kernel's plan for this step (None where that kernel cannot run or no sequence is
        long enough), decided and built by the first layer and reused by the rest (paged_prefill_attention
        still checks each layer's tensors before it runs the kernel)."""
        state = metadata.backend_state
        if "query_tile_plan" not in state:
            usable = (key is not None and metadata.max_query_len >= prefill_attention_sm90.MIN_QUERY_LEN
                      and prefill_attention_sm90.supported(query, key, value, k_cache, v_cache))
            state["query_tile_plan"] = prefill_attention_sm90.plan_query_tiles(
                metadata.query_start_loc, metadata.seq_lens, query.shape[0]) if usable else None
        return state["query_tile_plan"]
