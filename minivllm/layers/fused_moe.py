"""Mixture-of-Experts layer: top-k routing plus the experts' SwiGLU MLPs over stacked weights.

Expert weights live in two stacked parameters, `w13_weight` [E, 2I, H] (each expert's gate rows then
up rows) and `w2_weight` [E, H, I], filled from the HF per-expert tensors by `weight_loader` with
shard id (expert, "w1" | "w3" | "w2") (Mixtral's names; Qwen's gate/up/down map onto them). On CUDA
Triton kernels route (minivllm.kernels.moe_routing) and run the experts (minivllm.kernels.fused_moe); elsewhere
their PyTorch references.
The router's linear layer belongs to the model's MoE block, which passes its logits in.

Tensor parallelism splits every expert's intermediate dimension across the ranks, as the dense MLP's
column/row-parallel pair does: each rank holds its rows of gate and up and its columns of down, so every
rank computes a partial sum for every token, and one all-reduce completes it. Routing is replicated (the
router is small and each rank needs every token's choice), so no token moves between ranks.
"""
from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed import get_tp_rank, get_tp_size, split_evenly, tensor_model_parallel_all_reduce
from minivllm.layers.fusion import fusions_enabled
from minivllm.quantization import current_moe_method


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """softmax over all experts in fp32, keep the top_k, optionally rescale them to sum to one
    (Mixtral always; Qwen-MoE when `norm_topk_prob`) -> (fp32 weights, int64 ids), each [T, top_k].
    Renormalised top-k softmax probabilities equal a softmax over the top-k logits (Mixtral's form)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    _SHARDS = ("w1", "w3", "w2")

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be in 1..num_experts ({num_experts})")
        self.num_experts = num_experts
        self.top_k = top_k
        self.tp_size = get_tp_size()
        # This rank's slice of each expert's intermediate dimension.
        self.intermediate_start, self.intermediate_size = split_evenly(intermediate_size, self.tp_size,
                                                                       get_tp_rank())
        if self.intermediate_size == 0:
            raise ValueError(f"an expert's intermediate size ({intermediate_size}) is smaller than "
                             f"tensor_parallel_size ({self.tp_size})")
        self.renormalize = renormalize
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        # 8-bit experts (quantization/moe_8bit.py) end up with codes in w13/w2_weight and per-row
        # w13/w2_scale buffers [E, rows]; None: experts in the model's dtype.
        self.quant_method = current_moe_method(self)
        if self.quant_method is not None:
            self.quant_method.create_weights(self)
        self.use_triton = fusions_enabled()

    def expected_shards(self, param_name: str) -> set:
        names = ("w2",) if param_name.endswith("w2_weight") else ("w1", "w3")
        return {(e, name) for e in range(self.num_experts) for name in names}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id) -> None:
        """Copy this rank's part of one expert's w1 (gate), w3 (up) or w2 (down) [out, in] into its slice."""
        try:
            expert, name = shard_id
        except (TypeError, ValueError):
            raise ValueError(f"expert weights need a shard id (expert, w1|w3|w2), got {shard_id!r}") from None
        if not 0 <= expert < self.num_experts or name not in self._SHARDS:
            raise ValueError(f"unknown expert shard {shard_id!r} ({self.num_experts} experts)")
        if (name == "w2") != (param is self.w2_weight):
            raise ValueError(f"shard {name!r} does not belong to this parameter")
        size = self.intermediate_size
        target = {"w1": lambda: param.data[expert, :size], "w3": lambda: param.data[expert, size:],
                  "w2": lambda: param.data[expert]}[name]()
        if self.tp_size > 1:
            start, dim = self.intermediate_start, 1 if name == "w2" else 0
            if loaded_weight.shape[dim] < start + size:
                raise ValueError(f"expert {expert} {name}: checkpoint {tuple(loaded_weight.shape)} is too small "
                                 f"for rows {start}..{start + size} of dimension {dim}")
            loaded_weight = loaded_weight.narrow(dim, start, size)
        if target.shape != loaded_weight.shape:
            raise ValueError(f"shape mismatch for expert {expert} {name}: parameter slice "
                             f"{tuple(target.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
        target.copy_(loaded_weight)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] -> [T, H]."""
        if self.use_triton and hidden_states.is_cuda:
            from minivllm.kernels.fused_moe import fused_experts
            from minivllm.kernels.moe_routing import route
            topk_weights, topk_ids = route(router_logits, self.top_k, self.renormalize)
        else:
            from minivllm.kernels.fused_moe import fused_experts_reference as fused_experts
            topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                            w13_scale=getattr(self, "w13_scale", None), w2_scale=getattr(self, "w2_scale", None))
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out
