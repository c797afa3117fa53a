"""Mixtral: Mistral's decoder (models/llama.py) with a sparse MoE block in every layer. The router keeps
the top-k of a softmax over all experts and always renormalises them (a softmax over the top-k logits).
Checkpoints name the block `block_sparse_moe` and each expert's projections w1 (gate), w3 (up) and
w2 (down)."""
from __future__ import annotations

from torch import nn

from minivllm.models.qwen3_moe import MoeForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoeForCausalLM):
    expert_projections = {"w1": "w1", "w3": "w3", "w2": "w2"}
    renamed_modules = {"block_sparse_moe": "mlp"}

    def make_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(hf_config.hidden_size, hf_config.num_local_experts,
                              hf_config.num_experts_per_tok, hf_config.intermediate_size, renormalize=True)
