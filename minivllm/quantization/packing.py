"""Integer codes packed into int32 words, and the plain-PyTorch dequantize + matmul reference.

Our one in-memory layout for weight-only formats (every loader converts to it once, after loading):
  qweight [K / (32 / bits), N] int32, packed along the input dimension: row r of the code matrix is
          the `bits`-wide field at bit (r % pack_factor) * bits of word row r // pack_factor (GPTQ's order);
  scales  [G, N] and zeros [G, N] (floats, zero in code units), G = ceil(K / group_size);
  weight  W[k, n] = (code[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n].
Holds no format-specific conventions (those live in gptq.py, awq.py, compressed_tensors.py).
"""
from __future__ import annotations

import torch


def pack_factor(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"unsupported bit width {bits} (2, 4 or 8)")
    return 32 // bits


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(pack_factor(bits), dtype=torch.int32, device=device) * bits


def unpack_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 [R / pf, N] -> codes int32 [rows, N] (field i of word row j is row j * pf + i)."""
    fields = (packed.unsqueeze(1) >> _shifts(bits, packed.device).view(1, -1, 1)) & ((1 << bits) - 1)
    return fields.reshape(-1, packed.shape[1])[:rows]


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [R, N] (0 <= code < 2**bits) -> int32 [ceil(R / pf), N]; the inverse of `unpack_rows`."""
    pf = pack_factor(bits)
    rows = codes.shape[0]
    padded = torch.zeros(-(-rows // pf) * pf, codes.shape[1], dtype=torch.int32, device=codes.device)
    padded[:rows] = codes.to(torch.int32)
    fields = padded.view(-1, pf, codes.shape[1]).to(torch.int64) << _shifts(bits, codes.device).view(1, -1, 1)
    return _wrap_int32(fields.sum(dim=1))


def _wrap_int32(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the same bits as int32."""
    return torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32)


def unpack_cols(packed: torch.Tensor, bits: int, cols: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 [R, C / pf] packed along columns -> codes [R, cols]. Field i of word c holds column
    c * pf + order[i] (order None: the identity)."""
    pf = pack_factor(bits)
    fields = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & ((1 << bits) - 1)   # [R, C/pf, pf]
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


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               bits: int, in_features: int) -> torch.Tensor:
    """W [K, N] in fp32 from our layout."""
    codes = unpack_rows(qweight, bits, in_features).float()
    group = torch.arange(in_features, device=qweight.device) // group_size
    return (codes - zeros.float()[group]) * scales.float()[group]


def weight_only_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                               zeros: torch.Tensor, group_size: int, bits: int = 4) -> torch.Tensor:
    """x [M, K] @ dequantized W [K, N]: weights formed in fp32, then the product in x's dtype."""
    w = dequantize(qweight, scales, zeros, group_size, bits, x.shape[-1])
    return x @ w.to(x.dtype)
