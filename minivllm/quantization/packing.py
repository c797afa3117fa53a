"""Integer codes packed into int32 words (GPTQ rows, AWQ/compressed-tensors columns) and back.

Our one in-memory layout for weight-only formats (every loader converts to it once, after loading):
  qweight [K / (32 / bits), N] int32, packed along the input dimension: row r of the code matrix is
          the `bits`-wide field at bit (r % pack_factor) * bits of word row r // pack_factor (GPTQ's order);
  scales  [G, N] and zeros [G, N] (floats, zero in code units), G = ceil(K / group_size);
  weight  W[k, n] = (code[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n].
Holds no format-specific conventions (those live in gptq.py, awq.py, compressed_tensors.py). Unpacking,
dequantizing and the reference GEMM live beside the kernel (kernels/int4_gemm.py); packing lives here.
"""
from __future__ import annotations

import torch

from minivllm.kernels.int4_gemm import (dequantize, field_shifts, pack_factor, unpack_rows,  # noqa: F401
                                        weight_only_gemm_reference)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [R, N] (0 <= code < 2**bits) -> int32 [ceil(R / pf), N]; the inverse of `unpack_rows`."""
    pf = pack_factor(bits)
    rows = codes.shape[0]
    padded = torch.zeros(-(-rows // pf) * pf, codes.shape[1], dtype=torch.int32, device=codes.device)
    padded[:rows] = codes.to(torch.int32)
    fields = padded.view(-1, pf, codes.shape[1]).to(torch.int64) << field_shifts(bits, codes.device).view(1, -1, 1)
    return _wrap_int32(fields.sum(dim=1))


def _wrap_int32(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the same bits as int32."""
    return torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32)


def unpack_cols(packed: torch.Tensor, bits: int, cols: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 [R, C / pf] packed along columns -> codes [R, cols]. Field i of word c holds column
    c * pf + order[i] (order None: the identity)."""
    pf = pack_factor(bits)
    fields = (packed.unsqueeze(-1) >> field_shifts(bits, packed.device)) & ((1 << bits) - 1)   # [R, C/pf, pf]
    if order is not None:
        fields = fields[..., torch.argsort(torch.tensor(order, device=packed.device))]
    return fields.reshape(packed.shape[0], -1)[:, :cols]


def pack_cols(codes: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """codes [R, C] -> int32 [R, ceil(C / pf)]; the inverse of `unpack_cols` with the same order."""
    return pack_rows(_reorder_fields(codes.t(), bits, order), bits).t().contiguous()


def _reorder_fields(codes_t: torch.Tensor, bits: int, order: list[int] | None) -> torch.Tensor:
    """Rows of `codes_t` reordered so that field i of each word takes row word * pf + order[i]."""
    if order is None:
        return codes_t
    pf = pack_factor(bits)
    rows = codes_t.shape[0]
    padded = torch.zeros(-(-rows // pf) * pf, codes_t.shape[1], dtype=codes_t.dtype, device=codes_t.device)
    padded[:rows] = codes_t
    return padded.view(-1, pf, codes_t.shape[1])[:, order].reshape(-1, codes_t.shape[1])
