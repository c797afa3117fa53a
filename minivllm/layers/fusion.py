"""Whether layers may swap their plain-PyTorch ops for the Triton fusions in `minivllm.kernels`, and the
fusions that span two layers: quantizing a W8A8 layer's input in the kernel that produces it; a gated
MLP's activation or attention's rotary embedding in the kernel of the projection before it; and a decoder
layer's RMSNorms, with the residual adds before them, in the kernel of the projection after them.

Only tensors on CUDA take the Triton path; `MINIVLLM_DISABLE_FUSIONS=1` (envs.py) turns it off, read when a
layer is built, to debug a fused path or measure what the fusions buy.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from minivllm import envs


def fusions_enabled() -> bool:
    if envs.MINIVLLM_DISABLE_FUSIONS:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fuse_input_quantization(model: nn.Module) -> int:
    """For each (producer, consumer) pair a module declares in `input_quant_pairs()` (submodule names: an
    RMSNorm or activation whose output goes to that linear layer and nowhere else), let the producer hand
    its output already quantized when the consumer's method quantizes its input per row (W8A8). At batch 1
    this removes three of the four activation-quantization kernels of a Llama layer. Returns the pairs fused."""
    if envs.MINIVLLM_DISABLE_FUSIONS:
        return 0
    fused = 0
    for module in model.modules():
        for producer_name, consumer_name in getattr(module, "input_quant_pairs", lambda: ())():
            producer, consumer = module.get_submodule(producer_name), module.get_submodule(consumer_name)
            dtype = getattr(getattr(consumer, "quant_method", None), "input_quant_dtype", None)
            if dtype is not None and getattr(producer, "can_quantize_output", False):
                producer.quantize_output = dtype
                fused += 1
    return fused


class PendingNorm(NamedTuple):
    """A decoder layer's norm(x + residual) (norm(x) where residual is None), not computed yet: the projection
    that reads it norms in its GEMV where its quant method can, and that GEMV also writes x + residual, the
    residual stream's next value, to `stream`; elsewhere `computed` runs the norm and fills `stream`."""
    x: torch.Tensor
    norm: nn.Module
    residual: torch.Tensor | None
    stream: torch.Tensor   # x itself where residual is None

    @classmethod
    def of(cls, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> "PendingNorm":
        return cls(x, norm, residual, x if residual is None else torch.empty_like(x))

    def row_norm(self, normed: torch.Tensor | None = None):
        """This norm as the kernels' RowNorm over rows of [1, K] (`normed`: where the kernel writes the norm's
        output too)."""
        from minivllm.kernels.rmsnorm import RowNorm
        if self.residual is None:
            return RowNorm(self.norm.weight, self.norm.eps, normed=normed)
        return RowNorm(self.norm.weight, self.norm.eps, self.residual.reshape(1, -1), self.stream.reshape(1, -1),
                       normed)


def computed(x: torch.Tensor | PendingNorm) -> torch.Tensor:
    """x, or a PendingNorm's norm computed by the norm layer as the plain layer does (its stream filled)."""
    if not isinstance(x, PendingNorm):
        return x
    if x.residual is None:
        return x.norm(x.x)   # the stream is x itself
    return x.norm(x.x, x.residual, residual_out=x.stream)[0]


def norms_in_gemvs(pairs, x: torch.Tensor) -> list[bool]:
    """For each (norm, projection) of a decoder layer at input x, whether the projection may take the norm as a
    PendingNorm: x is one token, the norm a plain RMSNorm on its Triton path (`fusable_into_gemv`, no quantized
    output) and the projection's quant method able to norm its input in its GEMV (`norms_input`: int4 at one row
    on Hopper; 16-bit weights at one row on the GPU where the grid is small, as an MoE router's, or the rows short
    enough for the streaming GEMV tiles). Each norm so
    taken runs no kernel of its own; its residual add happens in the same GEMV."""
    if envs.MINIVLLM_DISABLE_FUSIONS or x.shape[0] != 1:
        return [False] * len(pairs)
    return [getattr(norm, "fusable_into_gemv", False) and norm.use_triton and norm.quantize_output is None
            and getattr(proj.quant_method, "norms_input", lambda *_: False)(proj, x)
            for norm, proj in pairs]


def normed_linear(proj: nn.Module, x: torch.Tensor | PendingNorm, keep_input: bool = False):
    """(proj(x), x as proj took it) for a plain projection: a PendingNorm is normed in proj's GEMV where its quant
    method can (`apply_normed`), which with `keep_input` also writes the normed row for the layer's other consumers
    (else None in its place); otherwise computed first."""
    if isinstance(x, PendingNorm):
        method = getattr(proj.quant_method, "apply_normed", None)
        result = None if method is None else method(proj, x.x, x, keep_input)
        if result is not None:
            return result
        x = computed(x)
    return proj(x), x


def _normed_call(method, layer: nn.Module, x: torch.Tensor | PendingNorm, *args, **kwargs):
    """(method's output or None, x): a PendingNorm is normed in method's kernel where it can be, else computed
    first (and x is then the norm's output)."""
    if isinstance(x, PendingNorm):
        out = method(layer, x.x, *args, norm=x, **kwargs)
        if out is not None:
            return out, x
        x = computed(x)
    return method(layer, x, *args, **kwargs), x


def gate_up_activation(gate_up: nn.Module, act: nn.Module, x: torch.Tensor | PendingNorm) -> torch.Tensor:
    """act(gate_up(x)) for a gated MLP. Where `act` is a plain SiluAndMul (Triton path, no quantized output) and
    gate_up's quant method computes silu(gate) * up in its GEMM's epilogue (`apply_silu_and_mul`: int4 at one
    row on Hopper), one kernel, which also norms a PendingNorm's x; otherwise the layers one by one."""
    method = getattr(gate_up.quant_method, "apply_silu_and_mul", None)
    if (method is not None and getattr(act, "fusable_into_gate_up", False) and act.use_triton
            and act.quantize_output is None):
        out, x = _normed_call(method, gate_up, x)
        if out is not None:
            return out
    return act(normed_linear(gate_up, x)[0])


def qkv_rotary(qkv_proj: nn.Module, rotary: nn.Module, positions: torch.Tensor, x: torch.Tensor | PendingNorm,
               head_dim: int, rotated_heads: int, kv_cache: tuple | None = None) -> tuple[torch.Tensor, bool]:
    """(qkv_proj(x), whether its first `rotated_heads` heads (q, k) already hold the rotary embedding at
    `positions`): rotated in the GEMM's epilogue where the rotary layer is the plain full-width neox one on its
    Triton path and qkv_proj's quant method can (`apply_rotary`: int4 at one row on Hopper), which also norms a
    PendingNorm's x. `kv_cache` (Attention.kv_write_target): where rotated, k and v were also stored there by
    the same kernel."""
    method = getattr(qkv_proj.quant_method, "apply_rotary", None)
    if (method is not None and getattr(rotary, "fusable_into_qkv", False) and rotary.use_triton
            and rotary.cos_sin_cache.shape[-1] == head_dim and positions.numel() == 1):
        out, x = _normed_call(method, qkv_proj, x, positions, rotary.cos_sin_cache, head_dim, rotated_heads,
                              kv_cache=kv_cache)
        if out is not None:
            return out, True
    return normed_linear(qkv_proj, x)[0], False
