"""HF architecture name -> model class. Every supported architecture is the one Llama-family class;
its variants are config options (see models/llama.py)."""
from __future__ import annotations

from torch import nn

from minivllm.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config) -> type[nn.Module]:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in _MODELS:
            return _MODELS[arch]
    model_type = getattr(hf_config, "model_type", None)
    if not architectures and model_type in _MODEL_TYPES:
        return _MODELS[_MODEL_TYPES[model_type]]
    raise ValueError(f"unsupported model architecture {architectures or model_type!r}; "
                     f"supported: {supported_architectures()}")
