"""KV cache sizing and allocation: how many blocks fit the memory budget, and the per-layer tensors.

The cache's dtype is the model's, or float8_e4m3fn with kv_cache_dtype="fp8" (one byte per element, so
the same budget holds twice the blocks of a bf16 cache; ARCHITECTURE.md, "FP8 KV cache")."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 1024 * 1024


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """vLLM's names: "auto" keeps the model's dtype; "fp8" and "fp8_e4m3" store float8_e4m3fn."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {kv_cache_dtype!r}")


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def kv_cache_budget(device: torch.device, gpu_memory_utilization: float, kv_cache_memory: int | None,
                    peak_non_kv_bytes: int) -> int:
    """Bytes available for KV blocks.

    On CUDA: the share of total device memory allowed by `gpu_memory_utilization`, minus what weights and the
    peak activations of a profiling forward pass took (measured by the caller). On CPU: `kv_cache_memory`.
    """
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_MEMORY
    free, total = torch.cuda.mem_get_info(device)
    # Memory held by other processes on the card also counts against our share.
    used_by_others = max(0, total - free - torch.cuda.memory_reserved(device))
    budget = int(total * gpu_memory_utilization) - peak_non_kv_bytes - used_by_others
    if budget <= 0:
        raise ValueError(f"no memory left for the KV cache: {total * gpu_memory_utilization / 2**30:.1f} GiB allowed, "
                         f"{peak_non_kv_bytes / 2**30:.1f} GiB taken by weights and activations, "
                         f"{used_by_others / 2**30:.1f} GiB by other processes on the device; "
                         f"raise gpu_memory_utilization or use a smaller model")
    return budget


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]; layer l's K is cache[0, l]."""
    return torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)

