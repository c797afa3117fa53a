"""`minivllm quantize`: quantize a Llama-family checkpoint offline into a GPTQ-, AWQ- or W8A8 folder.

rtn and gptq write AutoGPTQ's layout (v1: stored zero - 1, so asymmetric zeros are kept >= 1), awq
writes AutoAWQ's GEMM layout; both with config.json's `quantization_config`, fp16 non-quantized
tensors and the tokenizer files, so minivllm, vLLM and transformers' loaders read the folder.
With `w8a8="fp8"` or `"int8"`, rtn and gptq write 8-bit weights with per-channel scales for dynamic
per-token activations instead, in compressed-tensors' float-/int-quantized format (llm-compressor's
FP8_DYNAMIC and W8A8 schemes). `smooth_alpha` applies SmoothQuant (smoothquant.py) before rounding.
Calibration (gptq, awq) runs the transformers model over `num_samples` windows of `seq_len` tokens of
a text file and accumulates, per linear-layer input, H = X^T X and mean |x| (one pass, all layers).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import NamedTuple

import torch

from minivllm.quantization.algorithms import (awq_search_clip, awq_search_scale, dequantize_groups, gptq_quantize,
                                              gptq_quantize_rows, quantize_rtn)
from minivllm.quantization.awq import AWQ_ORDER
from minivllm.quantization.calibration import (calibration_tokens, calibration_windows, collect_input_stats,
                                               fold_input_scales)
from minivllm.quantization.distill import GroupRounding, RowRounding, distill
from minivllm.quantization.packing import pack_cols, pack_rows
from minivllm.quantization.sequential import SequentialCalibration, fit_to_full_precision
from minivllm.quantization.smoothquant import smooth_layers

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DISTILL_LR = 0.01          # weights: grid steps per Adam step, at the top of the schedule
DISTILL_SCALE_LR = 0.001   # scales' log-ratios and norm weights
# linear -> the projection whose input statistics it shares
INPUT_OF = {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "o_proj": "o_proj",
            "gate_proj": "gate_proj", "up_proj": "gate_proj", "down_proj": "down_proj"}


def apply_awq_scales(layer, stats: dict, index: int, bits: int, group_size: int) -> dict:
    """AWQ: the scales from its search over the output error of the rounded weights; returns each input
    site's scales s (the inputs are now x / s)."""
    return fold_input_scales(layer, stats, index, lambda weights, stat: awq_search_scale(
        weights, stat[0], stat[1], bits, group_size))


def awq_clip(w, names: list[str], row_counts: list[int], H: torch.Tensor, s: torch.Tensor | None, bits: int,
             group_size: int) -> torch.Tensor:
    """AWQ's clipping search on the scaled weights w (their inputs are x / s, so their H is H / (s s^T)).
    Like AutoAWQ, q_proj and k_proj keep their full ranges: their error reaches the output through the
    softmax, which the search's error measure does not see."""
    clip = awq_search_clip(w, H if s is None else H / torch.outer(s, s), bits, group_size)
    start = 0
    for name, count in zip(names, row_counts):
        if name in ("q_proj", "k_proj"):
            clip[start:start + count] = 1.0
        start += count
    return clip


def gptq_format_tensors(codes, scales, zeros, g_idx, bits: int) -> dict:
    return {"qweight": pack_rows(codes.t(), bits), "qzeros": pack_cols((zeros - 1).int(), bits),
            "scales": scales.half(), "g_idx": g_idx.int()}


def awq_format_tensors(codes, scales, zeros, g_idx, bits: int) -> dict:
    return {"qweight": pack_cols(codes.t(), bits, AWQ_ORDER), "qzeros": pack_cols(zeros.int(), bits, AWQ_ORDER),
            "scales": scales.half()}


def rounded_weight(part: GroupRounding | RowRounding) -> torch.Tensor:
    """The weights [N, K] a linear's rounding stands for."""
    if isinstance(part, RowRounding):
        return part.codes.float() * part.scale.float().view(-1, 1)
    return dequantize_groups(*part)


def w8a8_format_tensors(codes, scale) -> dict:
    return {"weight": codes, "weight_scale": scale.float().unsqueeze(1)}


def w8a8_quantization_config(kind: str, method: str) -> dict:
    """compressed-tensors' description of per-channel 8-bit weights and dynamic per-token activations."""
    numbers = {"num_bits": 8, "type": "float" if kind == "fp8" else "int", "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": f"{numbers['type']}-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"], "quantizer": f"minivllm-{method}",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {**numbers, "strategy": "channel", "dynamic": False},
                "input_activations": {**numbers, "strategy": "token", "dynamic": True}}}}


def quantization_config(method: str, bits: int, group_size: int, sym: bool, desc_act: bool,
                        sequential: bool = False) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "w_bit": bits, "q_group_size": group_size}
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": "gptq", "static_groups": False, "true_sequential": sequential,
            "damp_percent": 0.01, "quantizer": f"minivllm-{method}"}


class QuantizationOptions(NamedTuple):
    """What `minivllm quantize` was asked for (validated by `check_options`)."""
    method: str
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    w8a8: str | None = None
    smooth_alpha: float | None = None
    sequential: bool = False
    fp8_inputs: bool = False
    target_full_precision: bool = False
    grid_search: bool = False
    num_samples: int = 32
    seq_len: int = 256


def quantize_model(model: str | None, method: str, out: str, bits: int = 4, group_size: int = 128,
                   calib: str | None = None, num_samples: int = 32, seq_len: int = 256,
                   sym: bool | None = None, desc_act: bool = False, w8a8: str | None = None,
                   smooth_alpha: float | None = None, sequential: bool = False, fp8_inputs: bool = False,
                   target_full_precision: bool = False, grid_search: bool = False, distill_steps: int = 0,
                   distill_lr: float = DISTILL_LR, distill_scale_lr: float = DISTILL_SCALE_LR) -> Path:
    """Quantize `model` (HF folder or .gguf; None: the default model) into the folder `out`. gptq only:
    `sequential` calibrates each linear on the outputs of the already quantized ones (sequential.py);
    with it, `fp8_inputs` rounds the calibration activations per token to fp8 as served W8A8 fp8 does,
    and `target_full_precision` fits each linear to the unquantized model's outputs (GPTAQ-style).
    rtn and gptq int weights: `grid_search` picks each group's scale and zero from a grid of scaled ranges
    and shifted zeros (algorithms.search_group_params) instead of the group's min/max.
    `distill_steps` > 0: after rounding, fine-tune the weights on their grids, the scales and the norms
    towards the unquantized model on the calibration text (distill.py; `distill_lr` in grid steps for the
    weights, `distill_scale_lr` for the scales' log-ratios and the norms)."""
    options = check_options(method, bits, group_size, calib, sym, desc_act, w8a8, smooth_alpha, sequential,
                            fp8_inputs, target_full_precision, grid_search, distill_steps,
                            distill_lr, distill_scale_lr, num_samples, seq_len)
    hf_model, tokenizer = load_for_quantization(model)
    text = Path(calib).read_text(encoding="utf-8", errors="replace") if calib else None
    teacher = copy.deepcopy(hf_model) if distill_steps else None
    roundings, prefixes = round_linears(hf_model, tokenizer, text, options)
    if distill_steps:
        roundings = distill_roundings(hf_model, teacher, roundings, tokenizer, text, options, distill_steps,
                                      distill_lr, distill_scale_lr)
    return write_folder(hf_model, tokenizer, roundings, prefixes, options, out)


def check_options(method, bits, group_size, calib, sym, desc_act, w8a8, smooth_alpha, sequential, fp8_inputs,
                  target_full_precision, grid_search, distill_steps=0, distill_lr=DISTILL_LR,
                  distill_scale_lr=DISTILL_SCALE_LR, num_samples=32, seq_len=256) -> QuantizationOptions:
    """The options, with `sym`'s default filled in; a ValueError naming the first bad one."""
    if method not in ("rtn", "gptq", "awq"):
        raise ValueError(f"unknown method {method!r} (rtn, gptq or awq)")
    if method == "awq" and bits != 4:
        raise ValueError("awq writes 4-bit weights only")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if w8a8 not in (None, "fp8", "int8"):
        raise ValueError(f"w8a8 must be fp8 or int8, got {w8a8!r}")
    if w8a8 and method == "awq":
        raise ValueError("awq writes 4-bit weight-only folders; W8A8 takes rtn or gptq")
    if smooth_alpha is not None and method == "awq":
        raise ValueError("awq scales the inputs itself; smoothing applies to rtn and gptq")
    if smooth_alpha is not None and not 0 <= smooth_alpha <= 1:
        raise ValueError(f"smoothing alpha must be in [0, 1], got {smooth_alpha}")
    if (method != "rtn" or smooth_alpha is not None or distill_steps) and not calib:
        raise ValueError(f"{method}{' with smoothing' if smooth_alpha is not None else ''}"
                         f"{' with distillation' if distill_steps else ''} needs calibration text (--calib FILE)")
    if distill_steps < 0 or distill_lr < 0 or distill_scale_lr < 0 or distill_lr + distill_scale_lr == 0:
        raise ValueError(f"distillation needs steps >= 0 and learning rates >= 0, not both 0; got {distill_steps}, "
                         f"{distill_lr} and {distill_scale_lr}")
    if (sequential or fp8_inputs or target_full_precision) and method != "gptq":
        raise ValueError("sequential calibration applies to gptq only")
    if (fp8_inputs or target_full_precision) and not sequential:
        raise ValueError("fp8 inputs and full-precision targets need sequential calibration (--sequential)")
    if fp8_inputs and w8a8 != "fp8":
        raise ValueError("fp8 input rounding emulates W8A8 fp8 serving; it needs --w8a8 fp8")
    if grid_search and (method == "awq" or w8a8):
        raise ValueError("the grid search of group ranges applies to rtn and gptq integer weights (not awq, not w8a8)")
    sym = (method != "awq") if sym is None else sym
    if method == "awq" and sym:
        raise ValueError("awq's format is asymmetric (zero points); drop --sym")
    return QuantizationOptions(method, bits, group_size, sym, desc_act, w8a8, smooth_alpha, sequential, fp8_inputs,
                               target_full_precision, grid_search, num_samples, seq_len)


def load_for_quantization(model: str | None):
    """(the transformers model in fp32, its tokenizer)."""
    import transformers

    from minivllm.models.loader import resolve_model
    source = resolve_model(model)
    if source.weights_dir is None or source.tokenizer_dir is None:
        raise ValueError(f"{model!r} has no weights or no tokenizer to quantize with")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(source.weights_dir, dtype=torch.float32).eval()
    return hf_model, transformers.AutoTokenizer.from_pretrained(source.tokenizer_dir)


@torch.no_grad()
def round_linears(hf_model, tokenizer, text: str | None, options: QuantizationOptions) -> tuple[dict, dict]:
    """Choose every decoder linear's grid and codes: ({module: GroupRounding | RowRounding}, {module: its
    checkpoint prefix}). Smoothing and AWQ fold their scales into `hf_model` (its function is kept);
    sequential calibration leaves the rounded weights in it."""
    o = options
    stats, sequential_calibration = {}, None
    if o.method != "rtn" or o.smooth_alpha is not None:
        windows = calibration_windows(text, tokenizer, o.num_samples, o.seq_len)
        if o.smooth_alpha is not None or not o.sequential:
            stats = collect_input_stats(hf_model, windows)
        if o.smooth_alpha is not None:
            smooth_layers(hf_model, stats, o.smooth_alpha)
            if not o.sequential:
                stats = collect_input_stats(hf_model, windows)   # GPTQ needs the smoothed inputs' H
        if o.sequential:
            sequential_calibration = SequentialCalibration(hf_model, windows, fp8_inputs=o.fp8_inputs,
                                                           target_full_precision=o.target_full_precision)
    min_zero = 0 if (o.sym or o.method == "awq") else 1
    roundings, prefixes = {}, {}
    for index, layer in enumerate(hf_model.model.layers):
        if o.method == "awq":
            input_scales = apply_awq_scales(layer, stats, index, o.bits, o.group_size)
        linears = {prefix.rsplit(".", 1)[-1]: (prefix, module) for prefix, module in layer.named_modules()
                   if prefix.rsplit(".", 1)[-1] in LINEARS}
        for site in dict.fromkeys(INPUT_OF.values()):
            # GPTQ treats rows independently given H, so projections of one input are quantized as one matrix
            names = [name for name in LINEARS if INPUT_OF[name] == site]
            w = torch.cat([linears[name][1].weight.float() for name in names])
            sizes = [linears[name][1].weight.shape[0] for name in names]
            H = None
            if sequential_calibration is not None:
                H, _, _, D = sequential_calibration.input_stats(index, site)
                if D is not None:
                    w = fit_to_full_precision(w, H, D)
            elif o.method == "gptq":
                H = stats[(index, site)][0]
            if o.w8a8:
                dtype = torch.float8_e4m3fn if o.w8a8 == "fp8" else torch.int8
                if H is not None:
                    codes, scale = gptq_quantize_rows(w, H, dtype, o.desc_act)
                else:
                    from minivllm.kernels.quant_rows import quantize_rows_reference
                    codes, scale = quantize_rows_reference(w, dtype)
                parts = [RowRounding(c, s) for c, s in zip(codes.split(sizes), scale.view(-1).split(sizes))]
            else:
                if H is not None:
                    codes, scales, zeros, g_idx = gptq_quantize(w, H, o.bits, o.group_size, o.sym, o.desc_act,
                                                                min_zero=min_zero, grid_search=o.grid_search)
                else:
                    clip = awq_clip(w, names, sizes, stats[(index, site)][0], input_scales.get(site), o.bits,
                                    o.group_size) if o.method == "awq" else None
                    codes, scales, zeros, g_idx = quantize_rtn(w, o.bits, o.group_size, o.sym, min_zero, clip,
                                                               o.grid_search)
                parts = [GroupRounding(c, s, z, g_idx) for c, s, z in
                         zip(codes.split(sizes), scales.split(sizes, 1), zeros.split(sizes, 1))]
            for name, part in zip(names, parts):
                prefix, module = linears[name]
                roundings[module], prefixes[module] = part, f"model.layers.{index}.{prefix}"
                if sequential_calibration is not None:   # later sites and layers see (and compensate) this rounding
                    module.weight.copy_(rounded_weight(part))
        if sequential_calibration is not None:
            sequential_calibration.advance(index)
    return roundings, prefixes


def distill_roundings(hf_model, teacher, roundings: dict, tokenizer, text: str, options: QuantizationOptions,
                      steps: int, lr: float, scale_lr: float) -> dict:
    """`distill.distill` on the calibration text; W8A8 inputs rounded per token as served."""
    input_dtype = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}.get(options.w8a8)
    trained = distill(hf_model, teacher, roundings, calibration_tokens(text, tokenizer), steps, lr, scale_lr,
                      options.seq_len, options.bits, input_dtype=input_dtype)
    print(f"distillation: KL to the unquantized model {trained['first_kl']:.4e} -> {trained['last_kl']:.4e}")
    return trained["roundings"]


@torch.no_grad()
def write_folder(hf_model, tokenizer, roundings: dict, prefixes: dict, options: QuantizationOptions,
                 out: str) -> Path:
    """The folder: the linears in their format, the rest of `hf_model` in fp16, config.json with its
    quantization_config, the tokenizer files."""
    from safetensors.torch import save_file
    o = options
    write = awq_format_tensors if o.method == "awq" else gptq_format_tensors
    tensors = {}
    for module, part in roundings.items():
        packed = w8a8_format_tensors(*part) if isinstance(part, RowRounding) else write(*part, o.bits)
        for key, value in packed.items():
            tensors[f"{prefixes[module]}.{key}"] = value.contiguous()
        if module.bias is not None:
            tensors[f"{prefixes[module]}.bias"] = module.bias.half()
    tied = bool(getattr(hf_model.config, "tie_word_embeddings", False))
    tensors.update({name: t.half().contiguous() for name, t in hf_model.state_dict().items()
                    if name.rsplit(".", 2)[-2] not in LINEARS and not (tied and name == "lm_head.weight")})
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_model.config.to_dict()
    config["torch_dtype"] = "float16"
    config["quantization_config"] = (w8a8_quantization_config(o.w8a8, o.method) if o.w8a8 else
                                     quantization_config(o.method, o.bits, o.group_size, o.sym, o.desc_act,
                                                         o.sequential))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(folder))
    return folder
