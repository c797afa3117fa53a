"""Gemma (1): the Llama decoder with Gemma's choices swapped in after construction:
  * GeGLU MLP (`gelu_pytorch_tanh` gate) instead of SwiGLU;
  * `(1 + w)` RMSNorm computed in fp32 (layers/layernorm.py's GemmaRMSNorm);
  * token embeddings scaled by sqrt(hidden_size) (rounded to the model dtype first, as HF does);
  * tied embeddings and an explicit head_dim (256 on the released models).
Gemma-2 (soft-capping, sandwich norms, alternating sliding-window layers) builds on this in gemma2.py.
"""
from __future__ import annotations

import torch
from torch import nn

from minivllm.layers.activation import GeluAndMul
from minivllm.layers.embedding import VocabParallelEmbedding
from minivllm.layers.layernorm import GemmaRMSNorm, RMSNorm
from minivllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from minivllm.models.llama import LlamaForCausalLM


class GemmaMLP(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        act = getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
        if act not in ("gelu_pytorch_tanh", "gelu"):   # HF maps Gemma's legacy "gelu" to the tanh form
            raise ValueError(f"unsupported Gemma activation {act!r} (only 'gelu_pytorch_tanh')")
        size = hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hf_config.hidden_size, [size, size], bias=False)
        self.down_proj = RowParallelLinear(size, hf_config.hidden_size, bias=False)
        self.act_fn = GeluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class ScaledEmbedding(VocabParallelEmbedding):
    """Embedding rows times sqrt(hidden_size), the scale rounded to the weight dtype like HF's."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # A Python scalar (no device tensor, so CUDA graphs can capture it) holding the rounded value.
        scale = torch.tensor(self.embedding_dim ** 0.5, dtype=self.weight.dtype).item()
        return super().forward(input_ids) * scale


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config):
        super().__init__(hf_config)
        model = self.model
        with torch.device("meta"):   # its table is replaced at once by the existing (tied) parameter
            embedding = ScaledEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        embedding.weight = model.embed_tokens.weight
        model.embed_tokens = embedding
        for parent in [model, *model.layers, *(layer.self_attn for layer in model.layers)]:
            for name, child in list(parent.named_children()):
                if type(child) is RMSNorm:
                    setattr(parent, name, GemmaRMSNorm(child.weight.shape[0], child.eps))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(model.embed_tokens)

    def make_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        return GemmaMLP(hf_config)
