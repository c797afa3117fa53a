"""The linear method shared by the weight-only integer formats (GPTQ, AWQ, compressed-tensors).

Each format declares its on-disk tensors and converts them, once after loading, into our layout
(see packing.py): `qweight`, `scales`, `zeros`, and for GPTQ's act-order a `perm` of the input
features so that groups are contiguous. `apply` runs the Triton mixed-precision GEMM on CUDA and the
dequantize + matmul reference elsewhere.
"""
from __future__ import annotations

import torch
from torch import nn

from minivllm.quantization.base import shard_loader
from minivllm.quantization.packing import pack_cols, weight_only_gemm_reference


class WeightOnlyLinearMethod:
    zero_offset = 0   # what the checkpoint's stored zero points lack (GPTQ v1 stores zero - 1)
    symmetric = False   # the format's zero points are 2^(bits - 1) (dummy weights then have no others)

    def __init__(self, bits: int, group_size: int):
        self.bits = bits
        self.group_size = group_size

    @torch.no_grad()
    def init_dummy_weights(self, layer: nn.Module) -> None:
        """Codes uniform over every field, zero points at mid-range (asymmetric formats: each field one of the four
        codes around it, so that the GEMVs read zeros as they would a real asymmetric checkpoint's), scales giving
        weights of std ~0.02."""
        mid = (1 << (self.bits - 1)) - self.zero_offset
        for name, param in layer.named_parameters(recurse=False):
            if name in ("qweight", "weight_packed"):
                param.random_(-(1 << 31), (1 << 31) - 1)
            elif "zero" in name and not param.is_floating_point():   # packed along the outputs
                shape = (param.shape[0], param.shape[1] * (32 // self.bits))
                codes = torch.full(shape, mid) if self.symmetric else torch.randint(mid - 2, mid + 2, shape)
                param.copy_(pack_cols(codes.to(param.device), self.bits))
            elif "scale" in name:
                param.fill_(0.02 / (1 << (self.bits - 1)) * 1.7)

    def groups(self, input_size: int) -> tuple[int, int]:
        """(group size, number of groups); group_size -1 means one group over all inputs."""
        size = input_size if self.group_size in (-1, 0) else self.group_size
        return size, -(-input_size // size)

    def group_loader(self, layer: nn.Module, output_dim: int, packed_per_element: int = 1):
        """The loader of a group-wise tensor (scales, zero points): outputs along `output_dim`, groups along
        the other; with one group over all inputs every row-parallel rank keeps it whole."""
        if self.group_size in (-1, 0):
            return shard_loader(layer, output_dim, packed_per_element)
        return shard_loader(layer, output_dim, packed_per_element, 1 - output_dim, self.group_size, "group")

    def set_processed(self, layer: nn.Module, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor, dtype: torch.dtype, perm: torch.Tensor | None = None) -> None:
        """Install our layout (scales and zeros in the model's dtype), dropping what the format loaded."""
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
            delattr(layer, name)
        layer.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(scales.to(dtype).contiguous(), requires_grad=False)
        layer.zeros = nn.Parameter(zeros.to(dtype).contiguous(), requires_grad=False)
        layer.register_buffer("perm", perm, persistent=False)
        # every group's zero point the symmetric one (GPTQ `sym`, compressed-tensors): the one-row GEMV takes it as a
        # constant and streams codes and scales only, as vLLM's GPTQ-Marlin does for `sym` checkpoints
        mid = 1 << (self.bits - 1)
        layer.zero_point = mid if bool((layer.zeros == mid).all()) else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if layer.perm is not None:
            x = x[:, layer.perm]
        group_size, _ = self.groups(layer.input_size)
        if x.is_cuda:
            from minivllm.kernels.int4_gemm import weight_only_gemm
            out = weight_only_gemm(x, layer.qweight, layer.scales, layer.zeros, group_size, self.bits,
                                   zero_point=layer.zero_point)
        else:
            out = weight_only_gemm_reference(x, layer.qweight, layer.scales, layer.zeros, group_size, self.bits)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])

    def _one_row(self, layer: nn.Module, x: torch.Tensor, normed: bool = False) -> torch.Tensor | None:
        """x as the [1, K] row a fused GEMV takes (inputs permuted for act-order), or None where none applies: not
        CUDA, not one row, a bias to add before the epilogue, or (normed: the GEMV norms x itself) an act-order
        permutation, which the norm's weights and the residual would have to follow."""
        if not x.is_cuda or layer.bias is not None or x.numel() != x.shape[-1]:
            return None
        if normed and layer.perm is not None:
            return None
        row = x.reshape(1, -1)
        return row[:, layer.perm] if layer.perm is not None else row

    def norms_input(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether `apply_silu_and_mul` / `apply_rotary` can norm x themselves (layers/fusion.PendingNorm): one
        row on Hopper, 4-bit codes, no act-order permutation."""
        row = self._one_row(layer, x, normed=True)
        if row is None or self.bits != 4:
            return False
        from minivllm.kernels.int4_gemm import tma_gemv_supported
        return tma_gemv_supported(row, layer.qweight, layer.scales, layer.zeros, self.groups(layer.input_size)[0])

    @staticmethod
    def _row_norm(pending):
        """A layers/fusion.PendingNorm as the kernel's RowNorm (rows of [1, K])."""
        return None if pending is None else pending.row_norm()

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, norm=None) -> torch.Tensor | None:
        """silu(gate) * up of a bias-free gate_up layer ([gate | up] columns) from one kernel where the GEMM can
        take the activation (kernels/int4_gemm.weight_only_gemv_silu_and_mul: one row on Hopper); with `norm` (a
        layers/fusion.PendingNorm whose x is x), of its norm, computed in the same kernel. Else None."""
        row = self._one_row(layer, x, normed=norm is not None)
        if row is None:
            return None
        from minivllm.kernels.int4_gemm import weight_only_gemv_silu_and_mul
        group_size, _ = self.groups(layer.input_size)
        out = weight_only_gemv_silu_and_mul(row, layer.qweight, layer.scales, layer.zeros, group_size, self.bits,
                                            norm=self._row_norm(norm), zero_point=layer.zero_point)
        return None if out is None else out.reshape(*x.shape[:-1], out.shape[-1])

    def apply_rotary(self, layer: nn.Module, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_dim: int, rotated_heads: int, norm=None, kv_cache=None) -> torch.Tensor | None:
        """A bias-free qkv layer's output with its first `rotated_heads` heads rotated (neox) at `positions`
        from one kernel where the GEMM can take the rotation (kernels/int4_gemm.weight_only_gemv_rotary: one
        row on Hopper); with `norm` (a layers/fusion.PendingNorm whose x is x), of its norm, computed in the
        same kernel; with `kv_cache` (k_cache, v_cache, slot_mapping, kv_heads), its k and v heads also stored
        there by the same kernel. Else None."""
        row = self._one_row(layer, x, normed=norm is not None)
        if row is None:
            return None
        from minivllm.kernels.int4_gemm import weight_only_gemv_rotary
        from minivllm.kernels.int4_gemv_tma import KVWrite, Rotary, kv_write_supported
        kv = None if kv_cache is None else KVWrite(*kv_cache)
        if kv is not None and not kv_write_supported(row, kv, head_dim):
            return None
        group_size, _ = self.groups(layer.input_size)
        out = weight_only_gemv_rotary(row, layer.qweight, layer.scales, layer.zeros, group_size, self.bits,
                                      Rotary(positions, cos_sin_cache, head_dim, rotated_heads, kv),
                                      norm=self._row_norm(norm), zero_point=layer.zero_point)
        return None if out is None else out.reshape(*x.shape[:-1], out.shape[-1])
