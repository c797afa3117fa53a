"""Top-k routing of a Mixture-of-Experts layer in one kernel: softmax over the experts in fp32, the top_k
probabilities in descending order and, where the model asks, their rescaling to sum to one.

The plain-PyTorch form (`select_experts` in layers/fused_moe.py, the reference) is four kernels: softmax, topk,
sum and divide. At decode a step runs them once per MoE layer on a handful of rows, where each costs a launch
and a few microseconds of latency and nothing in bytes; here one program per token holds the token's logits in
registers and picks the top_k by repeated max over keys that pack a score above its expert's id (ties go to the lower
expert id). One max a pick instead of an argmax and a max, and with rescaling the picks made on the logits (the
softmax keeps their order) with only the top_k exponentiated: Qwen3-30B-A3B single stream 437.5 against 435.4 tok/s on
an H200, alternating in one process (bench/results/decode_ab_h200.json `route_packed_keys`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import launch_options, wait_for_previous


NO_KEY = tl.constexpr(-(1 << 62) * 2)   # -2^63, below every real key: padded experts and those already picked


@triton.jit
def _flip_negative(bits):
    """A float's int32 bits ordered as the floats are (negative floats: larger magnitude, smaller key), and back: the
    flip is its own inverse."""
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_lm, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_lm + experts, mask=valid, other=0.0).to(tl.float32)
    if RENORMALIZE:
        scores = logits
    else:
        exps = tl.where(valid, tl.exp(logits - tl.max(tl.where(valid, logits, -float("inf")), 0)), 0.0)
        scores = exps / tl.sum(exps, 0)
    ordered = _flip_negative(scores.to(tl.int32, bitcast=True))
    keys = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - experts).to(tl.int64)   # the id reversed: ties go low
    keys = tl.where(valid, keys, NO_KEY)
    slots = tl.arange(0, BLOCK_K)
    picked = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(keys, 0)
        picked = tl.where(slots == k, best, picked)
        keys = tl.where(keys == best, NO_KEY, keys)
    out = slots < TOP_K
    picked_ids = BLOCK_E - 1 - (picked & 0xFFFFFFFF)
    values = _flip_negative((picked >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
    if RENORMALIZE:   # softmax over the picked logits: the first pick is the largest
        exps = tl.where(out, tl.exp(values - tl.max(tl.where(out, values, -float("inf")), 0)), 0.0)
        values = exps / tl.sum(exps, 0)
    tl.store(weights_ptr + token * TOP_K + slots, values, mask=out)
    tl.store(ids_ptr + token * TOP_K + slots, picked_ids, mask=out)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (fp32 weights, int64 expert ids), each [T, top_k], as `select_experts`."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be in 1..num_experts ({num_experts})")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        block_e = triton.next_power_of_2(num_experts)
        _route_kernel[(num_tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                                     RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
                                     **launch_options(router_logits.device), num_warps=4 if block_e >= 256 else 1)
    return weights, ids
