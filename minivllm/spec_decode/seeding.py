"""Random numbers for speculative decoding that honour per-request seeds: unseeded rows come from one
batched draw, seeded rows from a generator seeded by (request seed, sample index, position, salt), so a
seeded request's draws do not depend on what else is in the batch."""
from __future__ import annotations

import torch

_generators: dict[torch.device, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    if device not in _generators:
        _generators[device] = torch.Generator(device=device)
    return _generators[device]


def _draw(shape: tuple[int, ...], device: torch.device, seeded_rows: list[int], row_seeds: list[int], salt: int,
          fill) -> torch.Tensor:
    out = torch.empty(shape, dtype=torch.float32, device=device)
    if len(seeded_rows) < shape[0]:
        fill(out, None)
    if seeded_rows:
        generator = _generator(device)
        for row, seed in zip(seeded_rows, row_seeds):
            generator.manual_seed((seed + salt * 0x9E3779B97F4A7C15) & ((1 << 63) - 1))
            fill(out[row], generator)
    return out


def exponential_noise(shape, device, seeded_rows: list[int], row_seeds: list[int], salt: int) -> torch.Tensor:
    return _draw(tuple(shape), device, seeded_rows, row_seeds, salt, lambda t, g: t.exponential_(generator=g))


def uniform(shape, device, seeded_rows: list[int], row_seeds: list[int], salt: int) -> torch.Tensor:
    return _draw(tuple(shape), device, seeded_rows, row_seeds, salt, lambda t, g: t.uniform_(generator=g))
