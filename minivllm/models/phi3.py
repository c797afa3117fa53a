"""Phi-3: the Llama decoder loaded from checkpoints that already fuse q/k/v (`qkv_proj`) and gate/up
(`gate_up_proj`) in the same order as ours, so those tensors load whole. Partial rotary embeddings
(Phi-4-mini) and LongRoPE scaling (the 128k variants) are rejected rather than computed wrongly.
The 4k models' sliding window (2047) equals full attention within it; the engine caps the context there.
"""
from __future__ import annotations

from minivllm.layers.rotary import rope_parameters_of
from minivllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config):
        _, scaling = rope_parameters_of(hf_config)
        factor = scaling.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
        if factor not in (None, 1.0):
            raise ValueError(f"Phi-3 with partial_rotary_factor {factor} is not supported (only 1.0)")
        super().__init__(hf_config)
