"""Reading a PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`) into CPU tensors
already in the slot layout of kernels/lora.py, so activating it is one copy per layer.

Owns the checks: what PEFT can save but this engine cannot apply (modules_to_save, DoRA, biases, per-module
rank or alpha patterns, targets outside q/k/v/o/gate/up/down) and adapters that do not fit the base model
(shapes, layers it lacks, a rank above max_lora_rank) are refused with a ValueError naming the reason.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<which>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


@dataclass
class LoRAModel:
    """One adapter on the host: {packed module name: (A [K, S*R], B [R, N])}, scaling folded into B."""
    lora_int_id: int
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _read_config(folder: Path, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of the folder's adapter_config.json, or the reason it cannot be served."""
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"{folder} is not a PEFT adapter folder: it has no adapter_config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder} holds a {config['peft_type']} adapter; only LORA is supported")
    if config.get("modules_to_save"):
        raise ValueError(f"{folder}: modules_to_save ({config['modules_to_save']}) replaces whole base modules; "
                         "not supported")
    for key, reason in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
                        ("rank_pattern", "per-module ranks (rank_pattern)"),
                        ("alpha_pattern", "per-module alphas (alpha_pattern)")):
        if config.get(key):
            raise ValueError(f"{folder}: {reason} not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{folder}: LoRA biases (bias={config['bias']!r}) not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{folder}: adapter_config.json needs a positive integer 'r' and a number 'lora_alpha'")
    if rank > max_lora_rank:
        raise ValueError(f"{folder}: rank {rank} exceeds max_lora_rank ({max_lora_rank})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    safetensors_path, bin_path = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if safetensors_path.is_file():
            from safetensors.torch import load_file
            return load_file(str(safetensors_path))
        if bin_path.is_file():
            return torch.load(bin_path, map_location="cpu", weights_only=True)
    except Exception as e:   # truncated or corrupt files raise many kinds of errors
        raise ValueError(f"cannot read the adapter weights in {folder}: {e}") from None
    raise ValueError(f"{folder} has no adapter_model.safetensors (or adapter_model.bin)")


def load_peft_adapter(lora_int_id: int, path: str, targets: dict, packed_modules_mapping: dict,
                      max_lora_rank: int, dtype: torch.dtype, pin_memory: bool = False) -> LoRAModel:
    """`targets`: {packed module name: its LoRALinearMethod} (input_size, projections, slice_widths);
    `packed_modules_mapping`: the model's checkpoint name -> (packed name, shard) map."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter folder {path!r} does not exist")
    rank, scaling = _read_config(folder, max_lora_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(folder).items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{folder}: tensor {key!r} is not a LoRA A/B weight of a linear layer; not supported")
        module, projection = match["module"].rpartition(".")[::2]
        packed = packed_modules_mapping.get(projection, (projection,))[0]
        target = targets.get(f"{module}.{packed}")
        if target is None or projection not in target.projections:
            supported = sorted({p for t in targets.values() for p in t.projections})
            raise ValueError(f"{folder}: adapter targets {match['module']!r}, which this model cannot apply LoRA "
                             f"to (supported projections: {', '.join(supported)})")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise ValueError(f"{folder}: the adapter holds no LoRA weights")

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, pair in pairs.items():
        module, projection = name.rpartition(".")[::2]
        packed_name = f"{module}.{packed_modules_mapping.get(projection, (projection,))[0]}"
        target = targets[packed_name]
        j = target.projections.index(projection)
        width = target.slice_widths[j]
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{folder}: {name} has {sorted(pair)} but needs both lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape != (rank, target.input_size) or b.shape != (width, rank):
            raise ValueError(f"{folder}: {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the base "
                             f"model needs ({rank}, {target.input_size}) and ({width}, {rank})")
        if packed_name not in weights:
            weights[packed_name] = (torch.zeros(target.input_size, len(target.projections) * max_lora_rank),
                                    torch.zeros(max_lora_rank, sum(target.slice_widths)))
        full_a, full_b = weights[packed_name]
        column = sum(target.slice_widths[:j])
        full_a[:, j * max_lora_rank:j * max_lora_rank + rank] = a.float().t()
        full_b[:rank, column:column + width] = b.float().t() * scaling
    for name, (a, b) in weights.items():
        a, b = a.to(dtype), b.to(dtype)
        weights[name] = (a.pin_memory(), b.pin_memory()) if pin_memory else (a, b)
    return LoRAModel(lora_int_id, rank, scaling, weights)
