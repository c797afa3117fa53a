"""HF architecture name (config.json's `architectures`) -> model class.

The Llama family is one class whose variants are config options (models/llama.py); the MoE models
reuse its decoder with a different MLP, Gemma with its norms, MLP and embedding swapped (Gemma-2/3 also
with their own decoder layer), Phi-3 as is (fused checkpoint tensors); GPT-2 has its own file. Classes are imported when first
asked for, so loading one family does not import the others.
"""
from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under minivllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel",
                "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def _load(arch: str) -> type[nn.Module]:
    module, name = _MODELS[arch]
    return getattr(importlib.import_module(f"minivllm.models.{module}"), name)


def get_model_class(hf_config) -> type[nn.Module]:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in _MODELS:
            return _load(arch)
    model_type = getattr(hf_config, "model_type", None)
    if not architectures and model_type in _MODEL_TYPES:
        return _load(_MODEL_TYPES[model_type])
    raise ValueError(f"unsupported model architecture {architectures or model_type!r}; "
                     f"supported: {supported_architectures()}")


def applies_sliding_window(hf_config) -> bool:
    """Whether the model masks keys outside its `sliding_window` itself (so the context need not stop
    at one window); False for unsupported architectures, which fail later with the list above."""
    try:
        return bool(getattr(get_model_class(hf_config), "applies_sliding_window", False))
    except ValueError:
        return False
