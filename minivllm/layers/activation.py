"""Activations for gated MLPs. The input holds both halves side by side, as `gate_up_proj` produces them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:] (SwiGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
