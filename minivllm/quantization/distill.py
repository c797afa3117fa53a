"""Distillation after rounding: fine-tune a quantized model's free values so that its next-token
distributions match the unquantized model's on the calibration text (KL divergence, the teacher's
distribution as target).

Once GPTQ, AWQ or round-to-nearest has chosen each linear's grid, the grid stays: group layout, act-order
g_idx and integer zero points (or the 8-bit format of a W8A8 row) are fixed. What moves is each weight's
position on its grid (a latent weight rounded in the forward, straight-through in the backward, so a code
changes when its latent crosses half a step), the grid's scales (one log-ratio per scale, starting at 0)
and the RMSNorm weights, which the folder stores unquantized. For W8A8 folders the linears' inputs are
rounded per token in the forward as the served path rounds them. The result is written in the same
on-disk format as without distillation (quantization-aware training by distillation, as in LLM-QAT / EfficientQAT,
restricted to the calibration text).

The quantizer owns the grids' first values and the writing; this module owns only the training. It runs
on the GPU when there is one.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from minivllm.kernels.quant_rows import round_to_codes, round_trip_rows


class GroupRounding(NamedTuple):
    """Weight-only integer groups of one linear: codes [N, K], scales / zeros [G, N], g_idx [K]."""
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor


class RowRounding(NamedTuple):
    """W8A8 weights of one linear: 8-bit codes [N, K] (float8_e4m3fn or int8), one scale per row [N]."""
    codes: torch.Tensor
    scale: torch.Tensor


def round_straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded` in the forward, the identity in the backward."""
    return x + (rounded - x).detach()


class GroupGrid(nn.Module):
    """w -> s (clamp(round(w / s) + z, 0, 2^bits - 1) - z) per (output, group), s = scales e^log_ratio."""

    def __init__(self, rounding: GroupRounding, bits: int):
        super().__init__()
        self.register_buffer("scales0", rounding.scales.float())
        self.register_buffer("zeros", rounding.zeros.float())
        self.register_buffer("g_idx", rounding.g_idx.long())
        self.log_ratio = nn.Parameter(torch.zeros_like(self.scales0))
        self.qmax = (1 << bits) - 1

    def initial_weight(self, rounding: GroupRounding) -> torch.Tensor:
        codes = rounding.codes.to(self.zeros.device).float()
        return (codes - self.zeros.t()[:, self.g_idx]) * self.scales0.t()[:, self.g_idx]

    def steps(self, initial: torch.Tensor) -> torch.Tensor:
        """The distance from each weight to its grid's neighbouring values, in weight units [N, K]."""
        return self.scales0.t()[:, self.g_idx].expand_as(initial).clone()

    def columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        scales = self.scales0 * self.log_ratio.exp()
        scales = round_straight_through(scales, scales.half().float())   # as the folder stores them
        return scales.t()[:, self.g_idx], self.zeros.t()[:, self.g_idx]

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        s, z = self.columns()
        scaled = latent / s
        codes = torch.clamp(round_straight_through(scaled, scaled.round()) + z, 0, self.qmax)
        return (codes - z) * s

    @torch.no_grad()
    def export(self, latent: torch.Tensor) -> GroupRounding:
        s, z = self.columns()
        codes = torch.clamp((latent / s).round() + z, 0, self.qmax).int()
        return GroupRounding(codes.cpu(), (self.scales0 * self.log_ratio.exp()).cpu(), self.zeros.int().cpu(),
                             self.g_idx.int().cpu())


class RowGrid(nn.Module):
    """w -> s round_to_codes(w / s) per output row, s = scale e^log_ratio; codes e4m3 or int8."""

    def __init__(self, rounding: RowRounding):
        super().__init__()
        self.dtype = rounding.codes.dtype
        self.register_buffer("scale0", rounding.scale.float().view(-1, 1))
        self.log_ratio = nn.Parameter(torch.zeros_like(self.scale0))

    def initial_weight(self, rounding: RowRounding) -> torch.Tensor:
        return rounding.codes.to(self.scale0.device).float() * self.scale0

    def steps(self, initial: torch.Tensor) -> torch.Tensor:
        """The distance from each weight to its grid's neighbouring values, in weight units [N, K]: int8
        codes lie one scale apart; e4m3 codes 2^(exponent - 3) apart (3 mantissa bits), 2^-9 below 2^-6."""
        if self.dtype == torch.int8:
            return self.scale0.expand_as(initial).clone()
        exponent = torch.floor(torch.log2((initial / self.scale0).abs().clamp(min=2.0 ** -6)))
        return torch.exp2(exponent - 3) * self.scale0

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        s = self.scale0 * self.log_ratio.exp()
        scaled = latent / s
        return round_straight_through(scaled, round_to_codes(scaled, self.dtype).float()) * s

    @torch.no_grad()
    def export(self, latent: torch.Tensor) -> RowRounding:
        s = self.scale0 * self.log_ratio.exp()
        return RowRounding(round_to_codes(latent / s, self.dtype).cpu(), s.view(-1).cpu())


class InGridSteps(nn.Module):
    """The latent weights in units of their own grid step (p -> p * steps), so one learning rate moves
    every weight the same fraction of a step, however far apart its grid's values are."""

    def __init__(self, steps: torch.Tensor):
        super().__init__()
        self.register_buffer("steps", steps)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return latent * self.steps

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.steps


def round_inputs(dtype: torch.dtype):
    """A forward pre-hook rounding a linear's input per token to `dtype`, as served W8A8 does."""
    def hook(module, args):
        return (round_straight_through(args[0], round_trip_rows(args[0], dtype)), *args[1:])
    return hook


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student)."""
    vocab = student_logits.shape[-1]
    return F.kl_div(F.log_softmax(student_logits.reshape(-1, vocab).float(), -1),
                    F.log_softmax(teacher_logits.reshape(-1, vocab).float(), -1),
                    log_target=True, reduction="batchmean")


def learning_rate_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first tenth of the steps, then a cosine to zero. Adam's first updates are
    about lr in every weight's gradient sign at once; at full lr that flips codes en masse."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def distill(student: nn.Module, teacher: nn.Module, roundings: dict, token_ids: torch.Tensor, steps: int,
            lr: float, scale_lr: float, seq_len: int, bits: int, batch_size: int = 8,
            input_dtype: torch.dtype | None = None, seed: int = 0, log=print) -> dict:
    """Train `student` (a transformers causal LM whose linears `roundings` {module: GroupRounding |
    RowRounding} describes) towards `teacher` for `steps` Adam steps on random `seq_len` windows of
    `token_ids` [T]. `lr` is in grid steps per Adam step for the latent weights (warm-up, then cosine
    decay); the scales' log-ratios and the norm weights take `scale_lr`. Returns {"roundings": {module: the
    new rounding} on the CPU, "first_kl", "last_kl"} and leaves `student` back on the CPU with plain weights
    equal to the new roundings and the trained norms."""
    if steps <= 0:
        raise ValueError(f"distillation needs a positive number of steps, got {steps}")
    if len(token_ids) < seq_len + 1:
        raise ValueError(f"calibration text has {len(token_ids)} tokens, fewer than one window of {seq_len}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    student.to(device).train()
    teacher.to(device).eval()
    for param in student.parameters():
        param.requires_grad_(False)
    latents, scale_params, grids = [], [], {}
    for module, rounding in roundings.items():
        grid = GroupGrid(rounding, bits) if isinstance(rounding, GroupRounding) else RowGrid(rounding)
        grid.to(device)
        initial = grid.initial_weight(rounding)
        with torch.no_grad():
            module.weight.copy_(initial)
        parametrize.register_parametrization(module, "weight", InGridSteps(grid.steps(initial)))
        parametrize.register_parametrization(module, "weight", grid)
        latents.append(module.parametrizations.weight.original.requires_grad_(True))
        scale_params.append(grid.log_ratio)
        grids[module] = grid
    norms = [p for name, p in student.named_parameters() if name.endswith("norm.weight")]
    for param in norms:
        param.requires_grad_(True)
    groups = [{"params": latents, "lr": lr}, {"params": scale_params + norms, "lr": scale_lr}]
    hooks = [module.register_forward_pre_hook(round_inputs(input_dtype)) for module in roundings] \
        if input_dtype is not None else []
    optimizer = torch.optim.Adam(groups)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    generator = torch.Generator().manual_seed(seed)
    losses = []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True   # only the training's products; the rounding is exact
    try:
        for step in range(steps):
            starts = torch.randint(0, len(token_ids) - seq_len, (batch_size,), generator=generator)
            batch = torch.stack([token_ids[s:s + seq_len] for s in starts.tolist()]).to(device)
            with torch.no_grad():
                target = teacher(batch).logits
            loss = kl_to_teacher(student(batch).logits, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * learning_rate_factor(step, steps)
            optimizer.step()
            losses.append(loss.item())
            if step == 0 or (step + 1) % max(1, steps // 10) == 0:
                log(f"distill step {step + 1}/{steps}: KL {loss.item():.4e}")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for handle in hooks:
            handle.remove()
    new = {}
    for module, grid in grids.items():
        in_grid_steps = module.parametrizations.weight[0]
        new[module] = grid.export(in_grid_steps(module.parametrizations.weight.original).detach())
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    for param in student.parameters():
        param.requires_grad_(False)
    student.cpu().eval()
    teacher.cpu()
    return {"roundings": new, "first_kl": losses[0], "last_kl": sum(losses[-10:]) / len(losses[-10:])}
