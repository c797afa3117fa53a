"""Gemma-2: Gemma (models/gemma.py: GeGLU, `(1 + w)` norms, sqrt(hidden)-scaled tied embeddings) with
  * sandwich norms: each sublayer's output is normed again (`post_attention_layernorm`,
    `post_feedforward_layernorm`) before it joins the residual stream, and the MLP has its own
    input norm (`pre_feedforward_layernorm`);
  * attention scaled by `query_pre_attn_scalar ** -0.5` instead of head_dim ** -0.5;
  * attention logit soft-capping (scores s -> c * tanh(s / c) before the mask, c =
    `attn_logit_softcapping`) and final logit soft-capping (`final_logit_softcapping`);
  * sliding-window attention on the layers `layer_types` marks "sliding_attention" (every other
    layer, from the first, on the released models), full attention on the others.
Window and cap are per-layer options of the Attention layer, applied by the backend and kernels; the
KV cache still holds every token of a sequence (sliding layers only mask the old ones).
"""
from __future__ import annotations

import torch

from minivllm.layers.attention import Attention
from minivllm.layers.layernorm import GemmaRMSNorm, norm_layer_input
from minivllm.models.gemma import GemmaForCausalLM, GemmaMLP
from minivllm.models.llama import LlamaDecoderLayer


def layer_types_of(hf_config, sliding_window_pattern: int = 2) -> list[str]:
    """'sliding_attention' or 'full_attention' per layer. Configs without `layer_types` make every
    `sliding_window_pattern`-th layer full (Gemma-2: every other one, Gemma-3: every sixth)."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(hf_config, "sliding_window_pattern", None) or sliding_window_pattern
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(hf_config.num_hidden_layers)]


class Gemma2DecoderLayer(LlamaDecoderLayer):
    sliding_window_pattern = 2   # for configs without `layer_types`: every second layer is full

    def __init__(self, hf_config, rotary_emb, layer_idx: int):
        super().__init__(hf_config, rotary_emb, GemmaMLP(hf_config))
        sliding = layer_types_of(hf_config, self.sliding_window_pattern)[layer_idx] == "sliding_attention"
        attn = self.self_attn.attn
        self.self_attn.attn = Attention(
            attn.num_heads, attn.head_dim, hf_config.query_pre_attn_scalar ** -0.5, attn.num_kv_heads,
            sliding_window=hf_config.sliding_window if sliding else None,
            logits_soft_cap=getattr(hf_config, "attn_logit_softcapping", None))
        eps = hf_config.rms_norm_eps
        self.pre_feedforward_layernorm = GemmaRMSNorm(hf_config.hidden_size, eps=eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hf_config.hidden_size, eps=eps)

    def forward(self, positions, hidden_states, residual):
        """Same contract as the Llama layer: (output, residual stream before it), summed by the next norm."""
        hidden_states, residual = norm_layer_input(self.input_layernorm, hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2ForCausalLM(GemmaForCausalLM):
    applies_sliding_window = True   # the engine need not cap the context at the window

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def make_layer(self, hf_config, rotary_emb, layer_idx: int) -> Gemma2DecoderLayer:
        return Gemma2DecoderLayer(hf_config, rotary_emb, layer_idx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        cap = self.final_logit_softcapping
        if cap is None or logits is None:   # None: a tensor-parallel rank other than the driver
            return logits
        return torch.tanh(logits / cap) * cap
