"""Rotary position embedding, neox style (rotate the two halves of each head), as HF Llama applies it.

`get_rope` reads the scaling dict in either transformers style: 4.x `rope_theta` + `rope_scaling`
(with "type" or "rope_type"), or 5.x `rope_parameters` holding `rope_theta` too. cos/sin are tabulated
once per position in fp32 (the same products HF computes on the fly) and gathered by position, so the
forward pass has no data-dependent shapes and can be captured in a CUDA graph.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from minivllm.layers.fusion import fusions_enabled
from minivllm.layers.layernorm import GemmaRMSNorm, RMSNorm


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are divided by `factor`, short ones kept, the band between
    interpolated smoothly."""
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    fusable_into_qkv = True   # layers/fusion.qkv_rotary: the cos | sin table read by a GEMM's epilogue

    def __init__(self, head_size: int, max_position: int, inv_freq: torch.Tensor):
        super().__init__()
        self.head_size = head_size
        # Built on the CPU in fp32 whatever the default dtype, then moved: the table must not be
        # rounded to bf16 before cos/sin (positions up to 1e5 lose all precision there).
        with torch.device("cpu"):
            positions = torch.arange(max_position, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq.float().cpu())
            cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)    # [max_position, head_size]
        self.register_buffer("cos_sin_cache", cos_sin.to(torch.get_default_device()), persistent=False)
        self.use_triton = fusions_enabled()

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                norms: tuple[nn.Module, nn.Module] | None = None):
        """positions [T]; query [T, H, D], key [T, KVH, D] -> rotated (same shapes and dtypes). `norms`: the
        per-head RMSNorms of q and k that come before the rotation (Qwen3, Gemma-3). On CUDA the Triton kernel
        normalises and rotates q and k in place."""
        return self.rotate_and_store(positions, query, key, norms=norms)[:2]

    def rotate_and_store(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor | None = None, norms: tuple[nn.Module, nn.Module] | None = None,
                         kv_cache: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """`forward`, and with `kv_cache` (Attention.kv_write_target) the rotated keys and `value` also stored in
        the paged cache where the Triton kernel runs: (query, key, whether k and v were stored)."""
        fused_norms = norms is not None and type(norms[0]) is type(norms[1]) in (RMSNorm, GemmaRMSNorm) \
            and norms[0].eps == norms[1].eps
        triton_path = self.use_triton and query.is_cuda
        if norms is not None and not (fused_norms and triton_path):
            query, key = norms[0](query), norms[1](key)
        if not triton_path:
            return (*self.forward_reference(positions, query, key), False)
        from minivllm.kernels.rotary import apply_rotary_
        weights, eps, gemma = None, 0.0, False
        if fused_norms:
            weights, eps, gemma = (norms[0].weight, norms[1].weight), norms[0].eps, type(norms[0]) is GemmaRMSNorm
        store = kv_cache is not None and value is not None
        query, key = apply_rotary_(positions, query, key, self.cos_sin_cache, weights, eps, gemma_norm=gemma,
                                   value=value if store else None, kv_cache=kv_cache if store else None)
        return query, key, store

    def forward_reference(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((sin, sin), dim=-1)
        query_out = query.float() * cos + rotate_half(query.float()) * sin
        key_out = key.float() * cos + rotate_half(key.float()) * sin
        return query_out.to(query.dtype), key_out.to(key.dtype)


def rope_parameters_of(hf_config) -> tuple[float, dict]:
    """(rope_theta, scaling dict or {}) from a transformers 4.x or 5.x config. Where 5.x keeps one dict per
    layer type (Gemma-3), this is the full-attention layers' one."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if legacy_scaling and not params:
        params = dict(legacy_scaling)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        theta = 10000.0
    return float(theta), params


def get_rope(head_size: int, max_position: int, rope_theta: float, rope_scaling: dict | None) -> RotaryEmbedding:
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    with torch.device("cpu"):   # frequencies as HF computes them, whatever device the model is built on
        inv_freq = default_inv_freq(head_size, rope_theta)
        if rope_type == "default":
            pass
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling["factor"], scaling["low_freq_factor"],
                                       scaling["high_freq_factor"],
                                       scaling["original_max_position_embeddings"])
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")
    return RotaryEmbedding(head_size, max_position, inv_freq)
