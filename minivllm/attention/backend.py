"""The attention backend interface: write this step's K/V into the paged cache, then attend."""
from __future__ import annotations

import abc

import torch

from minivllm.attention.metadata import AttentionMetadata


class AttentionBackend(abc.ABC):
    """Implementations must agree with `TorchAttentionBackend` (the oracle) on any valid metadata."""

    @abc.abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        """key/value [num_tokens, num_kv_heads, head_dim] -> cache slots; rows with slot -1 are skipped.
        An fp8 cache stores key / k_scale and value / v_scale, saturated (torch_backend.quantize_kv)."""

    @abc.abstractmethod
    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0, sliding_window: int | None = None,
               logits_soft_cap: float | None = None, key: torch.Tensor | None = None,
               value: torch.Tensor | None = None) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim] -> output of the same shape, causal over the
        sequence's cached context plus its own query tokens. Query heads map to KV heads in groups
        (head h uses KV head h // (num_heads // num_kv_heads)). An fp8 cache's entries are read as
        stored * k_scale (keys) and stored * v_scale (values). Per-layer options: `sliding_window` W
        limits the query at position p to keys at p - W < k <= p; `logits_soft_cap` c replaces each
        scaled score s by c * tanh(s / c) before masking and softmax (None: off). `key`/`value`,
        when given, are this step's K/V exactly as just passed to `write_kv`: a backend may read
        the query chunk's own keys from them rather than from the cache (same values)."""

