"""Reference paged attention in plain PyTorch: runs anywhere, and is the oracle the Triton kernels
are tested against. Loops over sequences (never over tokens); clarity over speed.

An fp8 cache (float8_e4m3fn) stores `x / scale` saturated to e4m3's range, and reads back `stored * scale`,
with one scale per layer for keys and one for values (ARCHITECTURE.md, "FP8 KV cache"); other caches
hold the values as they are and ignore the scales.

Per-layer options (Gemma-2): `sliding_window` W lets the query at position p see keys at positions
p - W < k <= p only; `logits_soft_cap` c turns each scaled score s into c * tanh(s / c) before the mask.
None (the default) means full causal attention and raw scores.
"""
from __future__ import annotations

import torch

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.metadata import AttentionMetadata


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = torch.finfo(FP8_KV_DTYPE).max   # 448: e4m3fn has no infinities, so casts must saturate


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Values as the cache stores them: divided by `scale` and saturated when the cache is fp8."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cached values in fp32, as attention reads them."""
    return x.float() * scale if x.dtype == FP8_KV_DTYPE else x.float()


def fp8_as_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 views of the same memory, others as they are: for indexing and block copies,
    which move bytes whatever they mean (CPU's index_copy_, for one, has no float8 kernel)."""
    return x.view(torch.uint8) if x.dtype == FP8_KV_DTYPE else x


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        rows = fp8_as_bytes(cache).view(num_blocks * block_size, *cache.shape[2:])
        rows[slots] = fp8_as_bytes(quantize_kv(x[valid], cache.dtype, scale))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence from the paged cache: [seq_len, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = fp8_as_bytes(cache)[block_table[:num_blocks].long()].view(cache.dtype)
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int, scale: float,
                        sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """One sequence in fp32: q [H, q, D] at positions first_position.., k/v [H, s, D] at positions 0..s-1."""
    scores = torch.matmul(q, k.transpose(1, 2)) * scale                    # [H, q, s]
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    q_pos = torch.arange(first_position, first_position + q.shape[1], device=q.device)
    k_pos = torch.arange(k.shape[1], device=q.device)
    mask = k_pos[None, :] > q_pos[:, None]
    if sliding_window is not None:
        mask |= k_pos[None, :] <= q_pos[:, None] - sliding_window
    scores.masked_fill_(mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)


def paged_attention_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              query_start_loc: list[int], seq_lens: list[int],
                              block_tables: torch.Tensor, scale: float,
                              k_scale: float = 1.0, v_scale: float = 1.0, sliding_window: int | None = None,
                              logits_soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged context, computed in fp32."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        q = query[start:end].float().transpose(0, 1)                       # [H, q, D]
        k = dequantize_kv(gather_context(k_cache, block_tables[i], seq_len), k_scale)
        v = dequantize_kv(gather_context(v_cache, block_tables[i], seq_len), v_scale)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)              # [H, s, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        # Query row r sits at position seq_len - q_len + r and sees positions <= itself.
        o = attention_reference(q, k, v, seq_len - q_len, scale, sliding_window, logits_soft_cap)
        out[start:end] = o.transpose(0, 1).to(query.dtype)
    return out


class TorchAttentionBackend(AttentionBackend):
    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale, k_scale=1.0, v_scale=1.0,
               sliding_window=None, logits_soft_cap=None, key=None, value=None):
        # key/value equal what write_kv just stored: the oracle reads everything from the cache.
        query_start_loc = metadata.query_start_loc_cpu or metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens_cpu or metadata.seq_lens.tolist()
        return paged_attention_reference(query, k_cache, v_cache, query_start_loc, seq_lens,
                                         metadata.block_tables, scale, k_scale, v_scale,
                                         sliding_window, logits_soft_cap)
