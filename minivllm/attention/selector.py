"""Choosing an attention backend by name. The backends import only the interface (backend.py); this module
sits above them and is the one place that knows them all."""
from __future__ import annotations

import torch

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """'torch' (reference, any device) or 'triton' (CUDA); None picks triton on CUDA."""
    if name is None:
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        # Imported on selection only: the Triton backend needs the triton package, the CPU path does not.
        from minivllm.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (choose 'torch' or 'triton')")
