"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2, chosen by config options.

Differences between the family members are config flags, not subclasses:
  * q/k/v bias: `attention_bias` (Llama, Qwen3), always on for Qwen2 (its HF code hard-codes it);
  * per-head RMSNorm of q and k before RoPE: Qwen3;
  * `head_dim` may differ from hidden_size / num_heads (Qwen3, Mistral-Nemo);
  * tied input/output embeddings: `tie_word_embeddings`.
Mistral's sliding window is not applied: it is exposed as `sliding_window` so the runner can cap the
context length at it (within the window, full attention is the same computation).

Parameter names follow HF checkpoints except for packing: q/k/v live in `qkv_proj` and gate/up in
`gate_up_proj` (one matmul each); `packed_modules_mapping` says where each checkpoint tensor goes.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
from torch import nn

from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention import Attention
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.fusion import PendingNorm, gate_up_activation, normed_linear, norms_in_gemvs, qkv_rotary
from minivllm.layers.layernorm import RMSNorm, norm_layer_input
from minivllm.layers.linear import (MergedColumnParallelLinear, PackedColumnLinear, QKVParallelLinear,
                                    RowParallelLinear)
from minivllm.layers.rotary import get_rope, rope_parameters_of


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def _attention_biases(hf_config) -> tuple[bool, bool]:
    """(bias of q/k/v, bias of o_proj)."""
    if hf_config.model_type == "qwen2":
        return True, False
    if hf_config.model_type == "qwen2_moe":
        return bool(getattr(hf_config, "qkv_bias", True)), False
    bias = bool(getattr(hf_config, "attention_bias", False))
    return bias, bias


class LlamaAttention(nn.Module):
    def __init__(self, hf_config, rotary_emb: nn.Module):
        super().__init__()
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_dim = _head_dim(hf_config)
        qkv_bias, o_bias = _attention_biases(hf_config)
        self.qkv_proj = QKVParallelLinear(hf_config.hidden_size, self.head_dim, total_heads,
                                          total_kv_heads, bias=qkv_bias)
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hf_config.hidden_size, bias=o_bias,
                                        input_partition=self.qkv_proj.q_partition)
        self.rotary_emb = rotary_emb
        if hf_config.model_type in ("qwen3", "qwen3_moe"):
            self.q_norm = RMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor | PendingNorm) -> torch.Tensor:
        kv_cache = None
        if self.q_norm is None:   # the rotation (and the KV write) may run in qkv_proj's epilogue (layers/fusion)
            x = hidden_states.x if isinstance(hidden_states, PendingNorm) else hidden_states
            kv_cache = self.attn.kv_write_target(x.dtype)
            qkv, rotated = qkv_rotary(self.qkv_proj, self.rotary_emb, positions, hidden_states, self.head_dim,
                                      self.num_heads + self.num_kv_heads, kv_cache)
        else:
            qkv, rotated = normed_linear(self.qkv_proj, hidden_states)[0], False
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if rotated:
            kv_written = kv_cache is not None
        else:   # one kernel: Qwen3's and Gemma-3's per-head q/k norms, the rotation, and k and v into the cache
            q, k, kv_written = self.rotary_emb.rotate_and_store(
                positions, q, k, v.view(-1, self.num_kv_heads, self.head_dim),
                None if self.q_norm is None else (self.q_norm, self.k_norm),
                self.attn.kv_write_target(qkv.dtype, one_token=False))
        out = self.attn(q.flatten(1), k.flatten(1), v, kv_written=kv_written)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, hf_config, intermediate_size: int | None = None):
        super().__init__()
        if hf_config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r} (only 'silu')")
        bias = bool(getattr(hf_config, "mlp_bias", False))
        size = intermediate_size or hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hf_config.hidden_size, [size, size], bias=bias)
        self.down_proj = RowParallelLinear(size, hf_config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        return self.down_proj(gate_up_activation(self.gate_up_proj, self.act_fn, x))

    def input_quant_pairs(self):
        """(producer, its only consumer) for layers/fusion.py."""
        return (("act_fn", "down_proj"),)

    def norm_consumer(self) -> nn.Module:
        """The projection that may take the norm before this MLP as a PendingNorm (layers/fusion.py)."""
        return self.gate_up_proj


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config, rotary_emb: nn.Module, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, rotary_emb)
        self.mlp = mlp if mlp is not None else LlamaMLP(hf_config)   # MoE models plug in theirs
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)

    def input_quant_pairs(self):
        """(producer, its only consumer) for layers/fusion.py: each norm's output feeds one packed
        projection (with Llama's own MLP; another MLP declares its own pairs)."""
        pairs = [("input_layernorm", "self_attn.qkv_proj")]
        if isinstance(self.mlp, LlamaMLP):
            pairs.append(("post_attention_layernorm", "mlp.gate_up_proj"))
        return pairs

    def norms_in_gemvs(self, hidden_states: torch.Tensor) -> tuple[bool, bool]:
        """Whether qkv_proj and the MLP's first projection (`norm_consumer`: gate_up_proj, an MoE block's router) run
        this call's input and post-attention norms (and the residual adds before them) in their GEMVs: one token,
        int4 on Hopper, or 16-bit weights on the GPU where the projection's grid is small, as an MoE router's
        (layers/fusion.norms_in_gemvs)."""
        consumer = getattr(self.mlp, "norm_consumer", None)
        if consumer is None:
            return False, False
        return tuple(norms_in_gemvs(((self.input_layernorm, self.self_attn.qkv_proj),
                                     (self.post_attention_layernorm, consumer())), hidden_states))

    def forward(self, positions, hidden_states, residual):
        """Returns (this layer's output, residual stream before it); the next norm adds the two."""
        input_in_gemv, post_in_gemv = self.norms_in_gemvs(hidden_states)
        if input_in_gemv:
            pending = PendingNorm.of(self.input_layernorm, hidden_states, residual)
            hidden_states, residual = self.self_attn(positions, pending), pending.stream
        else:
            hidden_states, residual = norm_layer_input(self.input_layernorm, hidden_states, residual)
            hidden_states = self.self_attn(positions, hidden_states)
        if post_in_gemv:
            pending = PendingNorm.of(self.post_attention_layernorm, hidden_states, residual)
            return self.mlp(pending), pending.stream
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, hf_config, make_mlp=None, make_layer=None):
        """`make_mlp(hf_config, layer_idx)`, if given, builds each layer's MLP (e.g. an MoE block);
        `make_layer(hf_config, rotary_emb, layer_idx)` each whole decoder layer (Gemma-2)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        # One cos/sin table shared by all layers (128k positions x 128 dims is 64 MB in fp32).
        rope_theta, rope_scaling = rope_parameters_of(hf_config)
        rotary_emb = get_rope(_head_dim(hf_config), hf_config.max_position_embeddings, rope_theta, rope_scaling)
        self.layers = nn.ModuleList(
            make_layer(hf_config, rotary_emb, i) if make_layer else
            LlamaDecoderLayer(hf_config, rotary_emb, make_mlp(hf_config, i) if make_mlp else None)
            for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """`num_layers`: run only the first layers, then the final norm (an early-exit draft model)."""
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers[:num_layers]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # checkpoint module name -> (packed module name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    make_mlp = None   # subclasses with another MLP (MoE, Gemma) set a method (hf_config, layer_idx) -> module
    make_layer = None  # ... or another decoder layer: (hf_config, rotary_emb, layer_idx) -> module (Gemma-2)

    def __init__(self, hf_config):
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config, self.make_mlp, self.make_layer)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        use_window = getattr(hf_config, "use_sliding_window", hf_config.model_type == "mistral")
        self.sliding_window = getattr(hf_config, "sliding_window", None) if use_window else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat token batch [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named checkpoint tensors; every parameter (and every shard of a packed one) must be
        covered, and no checkpoint tensor may be left without a home."""
        params = dict(self.named_parameters())
        loaded_shards: dict[str, set] = defaultdict(set)
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue   # recomputed from the config
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue   # some tied checkpoints still store a copy of the embedding
            param_name, shard_id = self._param_name_of(name)
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
            param = params[param_name]
            try:
                param.weight_loader(param, loaded_weight, shard_id)
            except ValueError as e:
                raise ValueError(f"cannot load {name!r} into {param_name!r}: {e}") from None
            loaded_shards[param_name].add(shard_id)
        missing = [name for name in params if not self._fully_loaded(name, loaded_shards[name])]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")

    def _param_name_of(self, checkpoint_name: str) -> tuple[str, object]:
        for ckpt_module, (packed_module, shard_id) in self.packed_modules_mapping.items():
            if f".{ckpt_module}." in checkpoint_name:
                return checkpoint_name.replace(f".{ckpt_module}.", f".{packed_module}."), shard_id
        return checkpoint_name, None

    def _fully_loaded(self, param_name: str, shards: set) -> bool:
        if None in shards:
            return True
        module = self.get_submodule(param_name.rsplit(".", 1)[0])
        return isinstance(module, PackedColumnLinear) and shards == set(module.shard_offsets)
