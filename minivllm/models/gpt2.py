"""GPT-2 (GPT2LMHeadModel): learned absolute positions, pre-LayerNorm blocks with biases, a GELU MLP
(tanh approximation, HF's `gelu_new`) and tied input/output embeddings.

HF stores GPT-2's projections as `Conv1D`, i.e. weights of shape [in, out]; they are transposed once at
load into the [out, in] layout of our linear layers. q/k/v already come fused (`c_attn`), so the
attention needs no packing. Parameter names follow the checkpoint (`transformer.h.{i}.attn.c_attn`);
checkpoints saved from the bare `GPT2Model` lack the `transformer.` prefix and get it added.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from minivllm.layers.activation import NewGELU
from minivllm.layers.attention import Attention
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import LayerNorm, norm_layer_input
from minivllm.layers.linear import ColumnParallelLinear, RowParallelLinear

# Checkpoint weights stored as Conv1D [in, out].
_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or \
                not getattr(hf_config, "scale_attn_weights", True):
            raise ValueError("GPT-2 variants without the plain 1/sqrt(head_dim) attention scale are not supported")
        self.c_attn = ColumnParallelLinear(hidden, 3 * hidden, bias=True)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_heads)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(hidden_states).chunk(3, dim=-1)
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation_function {hf_config.activation_function!r} "
                             "(only the tanh GELU: 'gelu_new')")
        inner = getattr(hf_config, "n_inner", None) or 4 * hf_config.hidden_size
        self.c_fc = ColumnParallelLinear(hf_config.hidden_size, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, hf_config.hidden_size, bias=True)
        self.act = NewGELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        eps = hf_config.layer_norm_epsilon
        self.ln_1 = LayerNorm(hf_config.hidden_size, eps)
        self.attn = GPT2Attention(hf_config)
        self.ln_2 = LayerNorm(hf_config.hidden_size, eps)
        self.mlp = GPT2MLP(hf_config)

    def forward(self, hidden_states, residual):
        """Same (output, residual) convention as the Llama decoder layer."""
        hidden_states, residual = norm_layer_input(self.ln_1, hidden_states, residual)
        hidden_states = self.attn(hidden_states)
        hidden_states, residual = self.ln_2(hidden_states, residual)
        return self.mlp(hidden_states), residual


class GPT2Model(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        self.wte = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.wpe = VocabParallelEmbedding(hf_config.max_position_embeddings, hf_config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(hf_config) for _ in range(hf_config.num_hidden_layers))
        self.ln_f = LayerNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        residual = None
        for block in self.h:
            hidden_states, residual = block(hidden_states, residual)
        hidden_states, _ = self.ln_f(hidden_states, residual)
        return hidden_states


class GPT2LMHeadModel(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        self.config = hf_config
        self.transformer = GPT2Model(hf_config)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.lm_head.tie_weights(self.transformer.wte)   # GPT-2 always ties them
        self.sliding_window = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, loaded_weight in weights:
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                continue   # causal-mask buffers of old checkpoints; the tied head
            if not name.startswith("transformer."):
                name = "transformer." + name
            if name.endswith(_CONV1D_WEIGHTS):
                loaded_weight = loaded_weight.t()
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
            try:
                params[name].weight_loader(params[name], loaded_weight)
            except ValueError as e:
                raise ValueError(f"cannot load {name!r}: {e}") from None
            loaded.add(name)
        missing = sorted(set(params) - loaded - {"lm_head.weight"})
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
