"""Weight quantization algorithms used by the offline quantizer (pure tensor functions, fp32, CPU).

* `quantize_rtn`: round-to-nearest per group of `group_size` inputs, symmetric (zero fixed at 2^(b-1),
  scale = 2 max|w| / (2^b - 1), GPTQ's convention) or asymmetric (min/max range, integer zero).
* `search_group_params`: a group's scale and zero from a grid of scaled ranges and shifted zeros, the
  one with the least (Hessian-diagonal-weighted) rounding error; `quantize_rtn` and `gptq_quantize` use
  it instead of min/max with `grid_search` (AutoGPTQ's `mse` option, plus the zero shifts).
* `gptq_loop` (Frantar et al. 2022): round one input column at a time and move each column's rounding
  error onto the columns not yet rounded, weighted by the inverse Hessian H = X^T X of the calibration
  inputs; optional act-order (columns in order of decreasing H diagonal). Two grids use it:
  `gptq_quantize` (integer groups with scale and zero, and g_idx) and `gptq_quantize_rows` (W8A8: fp8 or
  int8 codes under a per-channel scale).
* `awq_search_scale` (Lin et al. 2023): per-input-channel scales s = mean|x|^alpha chosen from a grid to
  minimise the output error of the rounded, scaled weights; the caller multiplies W by s and divides the
  op that feeds these inputs (a norm weight, up_proj's rows) by s. The output error of W' vs W on the
  calibration inputs is tr((W' - W) H (W' - W)^T), so only H is needed, never the activations.
Scales are rounded to fp16 (the checkpoint's dtype) before the codes are chosen.
"""
from __future__ import annotations

import torch


def group_params(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0,
                 clip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero per row of w [N, g]; `clip` [N] scales each row's range (values outside
    round to the end codes)."""
    top = (1 << bits) - 1
    lo = w.min(dim=1).values.clamp(max=0)
    hi = w.max(dim=1).values.clamp(min=0)
    if clip is not None:
        lo, hi = lo * clip, hi * clip
    if sym:
        scale = torch.maximum(-lo, hi) * 2 / top
    else:
        scale = (hi - lo) / top
    scale = scale.clamp(min=1e-6).half().float()
    if sym:
        zero = torch.full_like(scale, float((top + 1) // 2))
    else:
        zero = torch.round(-lo / scale).clamp(min_zero, top)
    return scale, zero


GRID_RANGE_FACTORS = tuple(1 - i / 50 for i in range(16))   # min/max, then down to 0.7
GRID_ZERO_SHIFTS = (0, -1, 1)


def search_group_params(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0,
                        importance: torch.Tensor | None = None, range_factors=GRID_RANGE_FACTORS,
                        zero_shifts=GRID_ZERO_SHIFTS) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_params` with a grid search per row of w [N, g]: the range [min, max] scaled by each factor
    in `range_factors` (below 1 the extremes round to the end codes) and (asymmetric) its integer zero
    moved by each of `zero_shifts` (which an integer zero needs when the weights sit on a grid with a
    float offset, as in Q4_1 sources); keeps the candidate whose rounding error sum_k importance_k (w_k - w'_k)^2 is smallest (importance [g]: the Hessian
    diagonal, how much each input moves the output; None: plain squared error). The first candidate is
    min/max itself, so the error never exceeds `group_params`'."""
    top = (1 << bits) - 1
    weight = torch.ones(w.shape[1]) if importance is None else importance.float()
    best_scale = best_zero = best_error = None
    for factor in range_factors:
        scale, zero = group_params(w, bits, sym, min_zero, torch.full((w.shape[0],), float(factor)))
        for shift in (0,) if sym else zero_shifts:
            z = (zero + shift).clamp(min_zero, top)
            delta = (quantize_codes(w, scale, z, bits) - z.unsqueeze(-1)) * scale.unsqueeze(-1) - w
            error = (delta * delta) @ weight
            if best_error is None:
                best_scale, best_zero, best_error = scale.clone(), z.clone(), error
                continue
            better = error < best_error
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, z, best_zero)
            best_error = torch.where(better, error, best_error)
    return best_scale, best_zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, (1 << bits) - 1)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool, min_zero: int = 0,
                 clip: torch.Tensor | None = None, grid_search: bool = False):
    """w [N, K] -> (codes [N, K] int, scales [G, N], zeros [G, N], g_idx [K]); `clip` [N, G]: range
    shrink per row and group (`awq_search_clip`); `grid_search`: each group's range by
    `search_group_params` (plain squared error) instead of min/max."""
    N, K = w.shape
    group_size = K if group_size <= 0 else group_size
    codes = torch.empty(N, K, dtype=torch.int32)
    scales, zeros = [], []
    for g, start in enumerate(range(0, K, group_size)):
        block = w[:, start:start + group_size]
        if grid_search:
            scale, zero = search_group_params(block, bits, sym, min_zero)
        else:
            scale, zero = group_params(block, bits, sym, min_zero, None if clip is None else clip[:, g])
        codes[:, start:start + group_size] = quantize_codes(block, scale, zero, bits).int()
        scales.append(scale)
        zeros.append(zero)
    return codes, torch.stack(scales), torch.stack(zeros), torch.arange(K) // group_size


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      g_idx: torch.Tensor) -> torch.Tensor:
    """`quantize_rtn` / `gptq_quantize`'s outputs back to weights [N, K]."""
    return (codes.float() - zeros.t()[:, g_idx]) * scales.t()[:, g_idx]


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    return dequantize_groups(*quantize_rtn(w, bits, group_size, sym))


def column_order(H: torch.Tensor, desc_act: bool) -> torch.Tensor:
    """GPTQ's rounding order: inputs by decreasing H diagonal (act-order; dead inputs count as 1) or as is."""
    diag = torch.diag(H).float().clone()
    diag[diag == 0] = 1.0
    return torch.argsort(diag, descending=True) if desc_act else torch.arange(H.shape[0])


@torch.no_grad()
def gptq_loop(w: torch.Tensor, H: torch.Tensor, round_column, desc_act: bool = False, damp_percent: float = 0.01,
              block: int = 128) -> torch.Tensor:
    """GPTQ's core: rounds the columns of w [N, K] one at a time, in H's activation order when desc_act,
    moving each column's rounding error onto the columns not yet rounded. `round_column(j, upcoming)`
    gets the input index j and the not-yet-rounded columns from j on (as updated so far, in this loop's
    order) and returns column j's rounded values; it keeps whatever codes and scales it made. Returns
    the permutation used (rounding order)."""
    W = w.float().clone()
    H = H.float().clone()
    N, K = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = column_order(H, desc_act)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp_percent * torch.diag(H).mean() * torch.eye(K)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, i1:i2].clone()
        errors = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            q = round_column(int(perm[col]), lambda i=i: torch.cat([W1[:, i:], W[:, i2:]], dim=1))
            error = (W1[:, i] - q) / Hinv[col, col]
            W1[:, i:] -= error.unsqueeze(1) * Hinv[col, col:i2].unsqueeze(0)
            errors[:, i] = error
        W[:, i2:] -= errors @ Hinv[i1:i2, i2:]
    return perm


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, sym: bool,
                  desc_act: bool = False, damp_percent: float = 0.01, min_zero: int = 0, grid_search: bool = False):
    """Same outputs as `quantize_rtn`; g_idx is a permuted grouping when desc_act. `grid_search`: each
    group's range by `search_group_params`, its error weighted by the H diagonal of the group's inputs."""
    N, K = w.shape
    order = column_order(H, desc_act)
    importance = torch.diag(H).float().clamp(min=0)
    group_size = K if group_size <= 0 else group_size
    codes = torch.empty(N, K, dtype=torch.int32)
    scales, zeros = [], []
    rounded = [0]   # columns rounded so far: a group starts every group_size of them

    def round_column(j, upcoming):
        if rounded[0] % group_size == 0:   # the group's range from its columns as updated so far
            if grid_search:
                inputs = order[rounded[0]:rounded[0] + group_size]
                scale, zero = search_group_params(upcoming()[:, :len(inputs)], bits, sym, min_zero,
                                                  importance[inputs])
            else:
                scale, zero = group_params(upcoming()[:, :group_size], bits, sym, min_zero)
            scales.append(scale)
            zeros.append(zero)
        rounded[0] += 1
        scale, zero = scales[-1], zeros[-1]
        q = quantize_codes(upcoming()[:, :1], scale, zero, bits)[:, 0]
        codes[:, j] = q.int()
        return (q - zero) * scale

    perm = gptq_loop(w, H, round_column, desc_act, damp_percent, block=min(group_size, 128)
                     if 128 % min(group_size, 128) == 0 else 128)
    g_idx = (torch.arange(K) // group_size)[torch.argsort(perm)]
    return codes, torch.stack(scales), torch.stack(zeros), g_idx


def gptq_quantize_rows(w: torch.Tensor, H: torch.Tensor, dtype: torch.dtype, desc_act: bool = True,
                       damp_percent: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8 weights by GPTQ: w [N, K] -> (codes [N, K] in `dtype` (float8_e4m3fn or int8), scale [N]).
    Each output channel keeps the scale of round-to-nearest (max |w| over the 8-bit range); GPTQ only
    chooses the rounding, so the folder is read like any per-channel W8A8 checkpoint."""
    from minivllm.kernels.quant_rows import quantize_rows_reference, round_to_codes
    _, scale = quantize_rows_reference(w.float(), dtype)
    scale = scale.view(-1)
    codes = torch.empty(w.shape, dtype=dtype)

    def round_column(j, upcoming):
        codes[:, j] = round_to_codes(upcoming()[:, 0] / scale, dtype)
        return codes[:, j].float() * scale

    gptq_loop(w, H, round_column, desc_act, damp_percent)
    return codes, scale


def output_error(delta: torch.Tensor, H: torch.Tensor) -> float:
    """Sum over calibration tokens of ||x delta^T||^2 = tr(delta H delta^T)."""
    return float(((delta @ H) * delta).sum())


@torch.no_grad()
def awq_search_scale(weights: list[torch.Tensor], H: torch.Tensor, x_abs_mean: torch.Tensor, bits: int,
                     group_size: int, grid: int = 20) -> torch.Tensor:
    """Per-input scales s [K] for linears sharing one input (the best of alpha in [0, 1))."""
    best, best_scale = float("inf"), torch.ones_like(x_abs_mean)
    for alpha in [i / grid for i in range(grid)]:
        s = x_abs_mean.clamp(min=1e-4).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        error = sum(output_error(fake_quantize(w * s, bits, group_size, False) / s - w, H) for w in weights)
        if error < best:
            best, best_scale = error, s
    return best_scale


@torch.no_grad()
def awq_search_clip(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, grid: int = 20,
                    max_shrink: float = 0.5) -> torch.Tensor:
    """AWQ's clipping search: for each row and group of w [N, K], the range shrink r in
    {1, 1 - 1/grid, ..., 1 - max_shrink} whose rounding error on the calibration inputs, the group's
    share delta H_gg delta^T of the output error, is smallest. Returns r [N, G]."""
    N, K = w.shape
    group_size = K if group_size <= 0 else group_size
    ratios = [1 - i / grid for i in range(int(max_shrink * grid))]
    best = torch.ones(N, -(-K // group_size))
    for g, start in enumerate(range(0, K, group_size)):
        block = w[:, start:start + group_size]
        h = H[start:start + group_size, start:start + group_size]
        least = torch.full((N,), float("inf"))
        for r in ratios:
            clip = torch.full((N,), r)
            scale, zero = group_params(block, bits, False, 0, clip)
            delta = (quantize_codes(block, scale, zero, bits) - zero.unsqueeze(-1)) * scale.unsqueeze(-1) - block
            error = ((delta @ h) * delta).sum(dim=1)
            better = error < least
            least = torch.where(better, error, least)
            best[better, g] = r
    return best
