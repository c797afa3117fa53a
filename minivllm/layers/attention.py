"""The attention layer: store this step's K/V in the paged cache (unless the kernel before did: `kv_write_target`),
then attend through the backend.

`k_cache` / `v_cache` are per-layer views `[num_blocks, block_size, num_kv_heads, head_dim]` and
`backend` an `AttentionBackend`, all set by the model runner after the KV cache is allocated. Before
that the caches are empty and the layer falls back to plain causal attention within each sequence of
the batch: only the runner's memory-profiling pass takes that path. Metadata comes from the forward
context; this module never builds it.

Per-layer options travel with the layer into the backend: `sliding_window` (keys older than the last W
positions are masked; the cache still holds them) and `logits_soft_cap` (Gemma-2's tanh capping of
the scores). Both default to None: plain causal attention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.metadata import AttentionMetadata, get_forward_context
from minivllm.attention.torch_backend import TorchAttentionBackend, attention_reference


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
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

    def kv_write_target(self, dtype: torch.dtype, one_token: bool = True) -> tuple | None:
        """(k_cache, v_cache, slot_mapping, kv_heads) for a kernel that stores this step's k and v itself (a GEMM's
        epilogue, layers/fusion.qkv_rotary, for one token; the rotary kernel for any number), then
        `forward(kv_written=True)`; None where the cache is absent, not in `dtype` (an fp8 cache's scales are this
        layer's) or, with `one_token`, the step has more than one token."""
        if self.k_cache.numel() == 0 or self.k_cache.dtype != dtype:
            return None
        slot_mapping = get_forward_context().slot_mapping
        if one_token and slot_mapping.numel() != 1:
            return None
        return self.k_cache, self.v_cache, slot_mapping, self.num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool = False) -> torch.Tensor:
        """q [T, H*D], k/v [T, KVH*D] -> [T, H*D]. `kv_written`: k and v are in the cache already
        (`kv_write_target`)."""
        meta = get_forward_context()
        query = q.view(-1, self.num_heads, self.head_dim)
        key = k.view(-1, self.num_kv_heads, self.head_dim)
        value = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() == 0:
            out = self._attend_without_cache(query, key, value, meta)
        else:
            if not kv_written:
                self.backend.write_kv(key, value, self.k_cache, self.v_cache, meta.slot_mapping,
                                      self.k_scale, self.v_scale)
            out = self.backend.attend(query, self.k_cache, self.v_cache, meta, self.scale,
                                      self.k_scale, self.v_scale, sliding_window=self.sliding_window,
                                      logits_soft_cap=self.logits_soft_cap,
                                      key=key, value=value)
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
        plain = self.sliding_window is None and self.logits_soft_cap is None
        for start, end in zip(starts[:-1], starts[1:]):
            if end == start:
                continue
            if not plain:   # SDPA has no soft cap: the reference math (profiling sequences are short)
                q, k, v = (x[start:end].transpose(0, 1).float() for x in (query, key, value))
                out[start:end] = attention_reference(q, k, v, 0, self.scale, self.sliding_window,
                                                     self.logits_soft_cap).transpose(0, 1).to(out.dtype)
                continue
            # SDPA wants [heads, tokens, dim].
            out[start:end] = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1), key[start:end].transpose(0, 1),
                value[start:end].transpose(0, 1), is_causal=True, scale=self.scale).transpose(0, 1)
        return out
