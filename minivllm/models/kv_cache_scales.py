"""Per-layer KV cache scales stored in a checkpoint (fp8 KV cache): take them out of the weight stream and
set them on the attention layers.

vLLM's spellings, per decoder layer i: `model.layers.i.self_attn.k_scale` / `v_scale` (compressed-tensors'
kv_cache_scheme, ModelOpt), `...self_attn.k_proj.k_scale` / `v_proj.v_scale`, `...k_proj.output_scale` /
`v_proj.output_scale` (Quark) and `...self_attn.kv_scale` (one scale for both). A scale s means the cache
stores x / s. Layers the checkpoint gives no scale keep 1.0 (ARCHITECTURE.md, "FP8 KV cache").
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Iterator

import torch
from torch import nn

from minivllm.layers.attention import Attention

_SCALE_NAME = re.compile(r"layers\.(\d+)\.\w+\.(?:(k|v)_scale|(k|v)_proj\.(?:[kv]_scale|output_scale)|(kv)_scale)$")


def extract_kv_cache_scales(weights: Iterable[tuple[str, torch.Tensor]],
                            scales: dict[int, dict[str, float]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the checkpoint's other tensors; collect its KV scales into `scales[layer] = {"k": .., "v": ..}`."""
    for name, tensor in weights:
        match = _SCALE_NAME.search(name)
        if match is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise ValueError(f"KV cache scale {name!r} must be one number (per-tensor), got shape "
                             f"{tuple(tensor.shape)}")
        value = float(tensor.float().item())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"KV cache scale {name!r} must be positive and finite, got {value}")
        layer, which = int(match.group(1)), match.group(2) or match.group(3) or match.group(4)
        for key in ("k", "v") if which == "kv" else (which,):
            scales.setdefault(layer, {})[key] = value


def set_kv_cache_scales(model: nn.Module, scales: dict[int, dict[str, float]]) -> None:
    layers = {}
    for name, module in model.named_modules():
        match = re.search(r"layers\.(\d+)\.", name)
        if isinstance(module, Attention) and match:
            layers[int(match.group(1))] = module
    for index, values in scales.items():
        if index not in layers:
            raise ValueError(f"the checkpoint has KV cache scales for layer {index}, which the model lacks")
        layers[index].k_scale = values.get("k", layers[index].k_scale)
        layers[index].v_scale = values.get("v", layers[index].v_scale)
