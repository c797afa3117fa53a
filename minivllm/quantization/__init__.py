"""Quantized linear layers behind one seam: a registry of formats by vLLM's names.

`get_quantization_config(hf_config, quantization)` reads config.json's `quantization_config` (as vLLM
auto-detects it) or the `quantization=` option; `quantization_context(config)` makes every
`LinearBase` built inside it take its method from that config, so models need no quantization code.
Formats are imported on first use (each is one module), so the unquantized path imports none.
"""
from __future__ import annotations

import contextlib
import importlib

from minivllm.quantization.base import QuantizationConfig

QUANTIZATION_METHODS = {
    "fp8": "minivllm.quantization.fp8:Fp8Config",
    "int8": "minivllm.quantization.int8:Int8Config",
    "gptq": "minivllm.quantization.gptq:GPTQConfig",
    "awq": "minivllm.quantization.awq:AWQConfig",
    "compressed-tensors": "minivllm.quantization.compressed_tensors:CompressedTensorsConfig",
    "gguf": "minivllm.quantization.gguf:GGUFConfig",   # only on a .gguf file (models/loader.py)
}
# Formats that can quantize a plain checkpoint while it loads (no calibration needed).
ONLINE_METHODS = ("fp8", "int8")

_current: list[QuantizationConfig | None] = [None]


def get_config_class(name: str) -> type[QuantizationConfig]:
    key = name.lower().replace("_", "-")
    key = {"compressed_tensors": "compressed-tensors", "gptq-marlin": "gptq", "awq-marlin": "awq"}.get(key, key)
    if key not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {name!r}; supported: {sorted(QUANTIZATION_METHODS)}")
    module, cls = QUANTIZATION_METHODS[key].split(":")
    return getattr(importlib.import_module(module), cls)


def get_quantization_config(hf_config, quantization: str | None = None,
                            load_format: str = "auto") -> QuantizationConfig | None:
    """The checkpoint's own quantization_config wins; `quantization` must then name the same format.
    Without one, `quantization` asks for online quantization (fp8, int8) of plain weights, or, with
    dummy weights, for random weights created directly in the format."""
    stored = getattr(hf_config, "quantization_config", None)
    if stored is not None and not isinstance(stored, dict):
        stored = stored.to_dict()
    if stored:
        name = stored.get("quant_method", "")
        cls = get_config_class(name)
        if quantization is not None and get_config_class(quantization) is not cls:
            raise ValueError(f"the checkpoint is quantized with {name!r}, not {quantization!r}")
        return cls.from_config(stored)
    if quantization is None:
        return None
    cls = get_config_class(quantization)
    if load_format == "dummy":
        return cls.for_dummy()
    if cls.name not in ONLINE_METHODS:
        raise ValueError(f"quantization {quantization!r} needs a checkpoint quantized in that format "
                         f"(config.json has no quantization_config); online quantization supports {ONLINE_METHODS}")
    return cls.from_config({"quant_method": cls.name, "serialized": False})


@contextlib.contextmanager
def quantization_context(config: QuantizationConfig | None):
    _current.append(config)
    try:
        yield
    finally:
        _current.pop()


def current_quant_method(layer):
    """The method the active config gives `layer`, or None (plain weights)."""
    config = _current[-1]
    return None if config is None else config.get_quant_method(layer)


def current_moe_method(layer):
    """The method the active config gives a FusedMoE layer's experts, or None (the model's dtype)."""
    config = _current[-1]
    return None if config is None else config.get_moe_method(layer)


def current_lm_head_method(layer):
    """The method for the LM head: only where the active config quantizes it (GPTQ's `lm_head: true`)."""
    config = _current[-1]
    return config.get_quant_method(layer) if config is not None and config.quantizes_lm_head else None


def init_dummy_quantized_weights(model) -> None:
    """After the loader's random fill: scales and zero points that keep activations at bf16's scale."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if hasattr(method, "init_dummy_weights"):
            method.init_dummy_weights(module)


def process_weights_after_loading(model) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)

