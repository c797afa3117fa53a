"""SmoothQuant (Xiao et al. 2022) for W8A8: move activation outliers into the weights, offline.

Per-token 8-bit activations lose the most where a few input channels are much larger than the rest
(SmolLM2's q/k/v inputs: max |x| is ~15-20x the token's rms). For each group of linears sharing an input,
s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha) over the calibration text; W[:, j] is multiplied by s_j
and the op feeding the input (the RMSNorm weight, or up_proj's row j for down_proj) divided by it, so
the model computes the same function in full precision. The result is a plain (unquantized) folder,
served with `quantization="int8"` or `"fp8"`, which quantize it per channel at load.
"""
from __future__ import annotations

from pathlib import Path

import torch

from minivllm.quantization.calibration import calibration_windows, collect_input_stats, fold_input_scales


def smoothquant_scale(weights: list[torch.Tensor], x_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] for linears [N_i, K] sharing one input whose per-channel max |x| is `x_amax` [K]."""
    w_amax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    return x_amax.clamp(min=1e-5).pow(alpha) / w_amax.clamp(min=1e-5).pow(1 - alpha)


@torch.no_grad()
def smooth_layers(hf_model, stats: dict, alpha: float) -> None:
    """Apply SmoothQuant in place to every decoder layer of a transformers Llama-family model, from
    `collect_input_stats`' per-input max |x|."""
    for index, layer in enumerate(hf_model.model.layers):
        fold_input_scales(layer, stats, index, lambda weights, stat: smoothquant_scale(weights, stat[2], alpha))


@torch.no_grad()
def smooth_model(model: str | None, out: str, calib: str, alpha: float = 0.5, num_samples: int = 32,
                 seq_len: int = 256) -> Path:
    """Write the SmoothQuant-scaled model `model` (HF folder or .gguf; None: the default) to `out` (fp32)."""
    import transformers

    from minivllm.models.loader import resolve_model

    if not calib:
        raise ValueError("smoothquant needs calibration text (--calib FILE)")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    source = resolve_model(model)
    if source.weights_dir is None or source.tokenizer_dir is None:
        raise ValueError(f"{model!r} has no weights or no tokenizer to smooth with")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(source.weights_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source.tokenizer_dir)
    text = Path(calib).read_text(encoding="utf-8", errors="replace")
    stats = collect_input_stats(hf_model, calibration_windows(text, tokenizer, num_samples, seq_len))
    smooth_layers(hf_model, stats, alpha)
    hf_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)
