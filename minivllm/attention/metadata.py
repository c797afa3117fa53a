"""Attention metadata for one forward pass, and the forward context that carries it to the layers.

The batch is flat: the scheduled tokens of all sequences concatenated, sequence i owning query rows
`query_start_loc[i] : query_start_loc[i+1]`. Its query tokens are the *last* tokens of its context of
`seq_lens[i]` tokens (so the first `seq_lens[i] - query_len` come from the KV cache: prefix-cache hits,
earlier prefill chunks, or earlier decode steps).

KV cache layout, per layer: `k_cache`, `v_cache` of shape `[num_blocks, block_size, num_kv_heads, head_dim]`.
Token at position p of a sequence lives in block `block_tables[i, p // block_size]`, row `p % block_size`;
its flat slot is `block * block_size + p % block_size` (`slot_mapping`, -1 for padding rows that
must not be written).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [num_tokens] int64, -1 = skip
    query_start_loc: torch.Tensor  # [batch + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor         # [batch] int32, context length incl. this step's tokens
    block_tables: torch.Tensor     # [batch, max_blocks_per_seq] int32, unused entries arbitrary
    max_query_len: int
    max_seq_len: int
    # Host copies the reference backend iterates over (None on the fast path to avoid syncs).
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # The shortest sequence's query length, where the host knows it (graphs captured for any step do not).
    min_query_len: int | None = None
    # What the attention backend derives from this metadata once per step and reuses in every layer
    # (the Hopper prefill kernel's query-tile plan); a graph's capture must start it empty.
    backend_state: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


_forward_context: AttentionMetadata | None = None


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata):
    """Make `metadata` visible to the attention layers for the duration of one forward pass."""
    global _forward_context
    if _forward_context is not None:
        raise RuntimeError("forward contexts do not nest")
    _forward_context = metadata
    try:
        yield
    finally:
        _forward_context = None


def get_forward_context() -> AttentionMetadata:
    if _forward_context is None:
        raise RuntimeError("attention called outside set_forward_context()")
    return _forward_context
