"""The attention layer: store this step's K/V in the paged cache, then attend through the backend.

`k_cache` / `v_cache` are per-layer views `[num_blocks, block_size, num_kv_heads, head_dim]` and
`backend` an `AttentionBackend`, all set by the model runner after the KV cache is allocated. Before
that the caches are empty and the layer falls back to plain causal attention within each sequence of
the batch: only the runner's memory-profiling pass takes that path. Metadata comes from the forward
context; this module never builds it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.metadata import AttentionMetadata, get_forward_context
from minivllm.attention.torch_backend import TorchAttentionBackend


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])
        self.backend: AttentionBackend = TorchAttentionBackend()
        # An fp8 KV cache stores k / k_scale and v / v_scale: 1.0 unless the checkpoint provides scales
        # (models/kv_cache_scales.py; ARCHITECTURE.md, "FP8 KV cache"); other caches ignore them.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, KVH*D] -> [T, H*D]."""
        meta = get_forward_context()
        query = q.view(-1, self.num_heads, self.head_dim)
        key = k.view(-1, self.num_kv_heads, self.head_dim)
        value = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() == 0:
            out = self._attend_without_cache(query, key, value, meta)
        else:
            self.backend.write_kv(key, value, self.k_cache, self.v_cache, meta.slot_mapping,
                                  self.k_scale, self.v_scale)
            out = self.backend.attend(query, self.k_cache, self.v_cache, meta, self.scale,
                                      self.k_scale, self.v_scale)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _attend_without_cache(self, query, key, value, meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention of each sequence's query rows over themselves only (no cached context)."""
        starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        # Expanding KV heads to query heads keeps SDPA on its fused (flash) kernels on every torch
        # version, so profiling does not see the T x T score matrix of the math fallback.
        group = self.num_heads // self.num_kv_heads
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
        out = torch.empty_like(query)
        for start, end in zip(starts[:-1], starts[1:]):
            if end == start:
                continue
            # SDPA wants [heads, tokens, dim].
            out[start:end] = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1), key[start:end].transpose(0, 1),
                value[start:end].transpose(0, 1), is_causal=True, scale=self.scale).transpose(0, 1)
        return out
