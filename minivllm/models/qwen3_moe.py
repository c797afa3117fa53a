"""Qwen3-MoE and Qwen2-MoE: the Llama-family decoder (models/llama.py) with a sparse MoE block as the
MLP of every layer that `decoder_sparse_step` / `mlp_only_layers` make sparse (the others keep a
dense MLP). The router is a linear layer to E logits; `norm_topk_prob` says whether the kept top-k
probabilities are rescaled to sum to one. Qwen2-MoE adds a shared expert, always on, scaled by a
sigmoid gate. Qwen3-MoE's attention is Qwen3's (q/k norm), Qwen2-MoE's is Qwen2's (q/k/v bias).

Checkpoints store each expert separately (`mlp.experts.{e}.gate_proj/up_proj/down_proj`); they are
loaded into the stacked parameters of `FusedMoE` (models/llama.py's loader does the rest).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from minivllm.layers.fused_moe import FusedMoE
from minivllm.layers.fusion import PendingNorm, normed_linear
from minivllm.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from minivllm.models.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_expert: nn.Module | None = None):
        super().__init__()
        # The router stays in the model's dtype under any weight quantization, as the checkpoints that ship
        # quantized MoE models leave it: its logits pick the experts, and it is a sliver of the bytes.
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, quant_method=UnquantizedLinearMethod())
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, bias=False, quant_method=UnquantizedLinearMethod())
                                   if shared_expert else None)

    def norm_consumer(self) -> nn.Module:
        """The router takes the norm before this block as a PendingNorm (layers/fusion.py) and hands the normed row
        on to the experts: one kernel for the norm and the router's GEMV."""
        return self.gate

    def forward(self, hidden_states: torch.Tensor | PendingNorm) -> torch.Tensor:
        router_logits, hidden_states = normed_linear(self.gate, hidden_states, keep_input=True)
        out = self.experts(hidden_states, router_logits)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden_states))
            out = out + gate * self.shared_expert(hidden_states)
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """Common loading for the MoE models: per-expert checkpoint tensors -> (expert, w1|w3|w2) shards."""

    # checkpoint expert projection -> FusedMoE shard name
    expert_projections = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    # checkpoint module name -> ours (Mixtral calls its MoE block `block_sparse_moe`)
    renamed_modules: dict[str, str] = {}

    def _param_name_of(self, checkpoint_name: str) -> tuple[str, object]:
        for old, new in self.renamed_modules.items():
            checkpoint_name = checkpoint_name.replace(f".{old}.", f".{new}.")
        match = re.search(r"\.experts\.(\d+)\.(\w+)\.(\w+)$", checkpoint_name)
        if match and match.group(2) in self.expert_projections and match.group(3) != "weight":
            raise ValueError(f"checkpoint tensor {checkpoint_name!r}: quantized MoE experts are not supported "
                             "(FusedMoE loads unquantized expert weights only)")
        if match and match.group(2) in self.expert_projections:
            shard = self.expert_projections[match.group(2)]
            param = "w2_weight" if shard == "w2" else "w13_weight"
            return f"{checkpoint_name[:match.start()]}.experts.{param}", (int(match.group(1)), shard)
        return super()._param_name_of(checkpoint_name)

    def _fully_loaded(self, param_name: str, shards: set) -> bool:
        module = self.get_submodule(param_name.rsplit(".", 1)[0])
        if isinstance(module, FusedMoE):
            return shards == module.expected_shards(param_name)
        return super()._fully_loaded(param_name, shards)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    def make_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        sparse = (layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
                  and hf_config.num_experts > 0
                  and (layer_idx + 1) % getattr(hf_config, "decoder_sparse_step", 1) == 0)
        if not sparse:
            return LlamaMLP(hf_config)
        shared_size = getattr(hf_config, "shared_expert_intermediate_size", 0)   # Qwen2-MoE only
        shared = LlamaMLP(hf_config, shared_size) if shared_size else None
        return SparseMoeBlock(hf_config.hidden_size, hf_config.num_experts, hf_config.num_experts_per_tok,
                              hf_config.moe_intermediate_size, bool(hf_config.norm_topk_prob), shared)
