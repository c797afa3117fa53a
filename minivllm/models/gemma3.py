"""Gemma-3 text models (`Gemma3ForCausalLM`, the 1B; model_type gemma3_text): Gemma-2's decoder
(models/gemma2.py) with
  * `(1 + w)` RMSNorm of each query and key head before RoPE (`q_norm`, `k_norm`);
  * two RoPE tables: the full-attention layers' (`rope_theta`, with the checkpoint's scaling) and the
    sliding layers' (`rope_local_base_freq`, unscaled);
  * five sliding layers to one full one (`layer_types`; older configs: `sliding_window_pattern`) and,
    on the released models, no soft-capping.
The vision-language Gemma-3 models (`Gemma3ForConditionalGeneration`) are not supported.
"""
from __future__ import annotations

from minivllm.layers.layernorm import GemmaRMSNorm
from minivllm.layers.rotary import get_rope
from minivllm.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, layer_types_of
from minivllm.models.llama import _head_dim


def local_rope_parameters(hf_config) -> tuple[float, dict]:
    """(theta, scaling) of the sliding layers, from a transformers 5.x or 4.x config."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params.get("sliding_attention"), dict):
        local = dict(params["sliding_attention"])
        return float(local.pop("rope_theta", 10000.0)), local
    return float(getattr(hf_config, "rope_local_base_freq", 10000.0)), {}


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    sliding_window_pattern = 6

    def __init__(self, hf_config, rotary_emb, layer_idx: int):
        super().__init__(hf_config, rotary_emb, layer_idx)
        head_dim, eps = self.self_attn.head_dim, hf_config.rms_norm_eps
        self.self_attn.q_norm = GemmaRMSNorm(head_dim, eps=eps)
        self.self_attn.k_norm = GemmaRMSNorm(head_dim, eps=eps)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def make_layer(self, hf_config, rotary_emb, layer_idx: int) -> Gemma3DecoderLayer:
        """`rotary_emb` is the full-attention layers' table; the sliding layers share a second one."""
        if layer_types_of(hf_config, Gemma3DecoderLayer.sliding_window_pattern)[layer_idx] == "sliding_attention":
            if getattr(self, "local_rotary_emb", None) is None:
                self.local_rotary_emb = get_rope(_head_dim(hf_config), hf_config.max_position_embeddings,
                                                 *local_rope_parameters(hf_config))
            rotary_emb = self.local_rotary_emb
        return Gemma3DecoderLayer(hf_config, rotary_emb, layer_idx)
