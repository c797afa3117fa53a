"""A/B for one-token MoE decode: routing inside the expert GEMVs against the routing kernel in front of them.

Variant: the gate/up GEMV routes the token itself (softmax, top-k, renormalise over the router's logits) and streams
runs of its slots' rows, a few programs a SM, the next rows' loads in flight (as dense_gemv's streaming tiles); the
down GEMV either routes again before its PDL wait (the router's logits are two kernels back) or loads the ids the
gate/up GEMV wrote after it. Baseline: the shipped route kernel, then `_few_token_experts`. Each variant runs
eight layers of Qwen3-30B-A3B's shapes (router GEMV, routing, experts; distinct weights, so the experts stream
from HBM) captured in one CUDA graph; printed: microseconds a layer.

    python bench/kernels/moe_routed_gemv_ab.py
"""
import sys, time, os
import torch, triton, triton.language as tl
sys.path.insert(0, os.getcwd())
from minivllm.kernels.pdl import launch_options, wait_for_previous
from minivllm.kernels.moe_routing import route
from minivllm.kernels.fused_moe import _few_token_experts, fused_experts_reference
from minivllm.kernels.dense_gemv import gemv
from minivllm.kernels.split_k import num_sms


@triton.jit
def _top_k(logits_ptr, token, num_experts, stride_lm, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_lm + experts, mask=valid, other=-float("inf")).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, 0))
    probs = exps / tl.sum(exps, 0)
    remaining = tl.where(valid, probs, -1.0)
    slots = tl.arange(0, BLOCK_K)
    picked = tl.zeros((BLOCK_K,), dtype=tl.float32)
    picked_ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(remaining, 0, tie_break_left=True)
        picked = tl.where(slots == k, tl.max(remaining, 0), picked)
        picked_ids = tl.where(slots == k, best, picked_ids)
        remaining = tl.where(experts == best, -1.0, remaining)
    if RENORMALIZE:
        picked = picked / tl.sum(picked, 0)
    return picked, picked_ids.to(tl.int64)


@triton.jit
def _gate_up_routed_kernel(logits_ptr, x_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, num_experts, I, H, stride_lm,
                           stride_xm, stride_we, stride_wn, stride_om, rows_per_program, TOP_K: tl.constexpr,
                           RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    picked, ids = _top_k(logits_ptr, token, num_experts, stride_lm, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_TOPK)
    ks = tl.arange(0, BLOCK_TOPK)
    if tl.program_id(1) == 0:
        tl.store(weights_ptr + token * TOP_K + ks, picked, mask=ks < TOP_K)
        tl.store(ids_ptr + token * TOP_K + ks, ids, mask=ks < TOP_K)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    x = tl.load(x_ptr + token * stride_xm + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    first = tl.program_id(1) * rows_per_program
    last = tl.minimum(first + rows_per_program, TOP_K * I)
    offs_r = tl.arange(0, BLOCK_N)
    r = first + offs_r
    k = r // I
    expert = tl.sum(tl.where(ks[None, :] == k[:, None], ids[None, :], 0), axis=1)
    rows = w_ptr + expert * stride_we + (r % I).to(tl.int64) * stride_wn
    mask = (r < last)[:, None] & h_mask[None, :]
    g = tl.load(rows[:, None] + offs_h[None, :], mask=mask, other=0.0)
    u = tl.load(rows[:, None] + I * stride_wn + offs_h[None, :], mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    for start in range(first, last, BLOCK_N):
        r = start + offs_r
        valid = r < last
        nr = r + BLOCK_N
        nk = nr // I
        nexpert = tl.sum(tl.where(ks[None, :] == nk[:, None], ids[None, :], 0), axis=1)
        nrows = w_ptr + nexpert * stride_we + (nr % I).to(tl.int64) * stride_wn
        nmask = (nr < last)[:, None] & h_mask[None, :]
        g_next = tl.load(nrows[:, None] + offs_h[None, :], mask=nmask, other=0.0)
        u_next = tl.load(nrows[:, None] + I * stride_wn + offs_h[None, :], mask=nmask, other=0.0)
        gate = tl.sum(g.to(tl.float32) * x[None, :], axis=1).to(dtype).to(tl.float32)
        up = tl.sum(u.to(tl.float32) * x[None, :], axis=1)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
        tl.store(out_ptr + (token * TOP_K + r // I) * stride_om + r % I, act.to(dtype), mask=valid)
        g = g_next
        u = u_next


@triton.jit
def _down_routed_kernel(a_ptr, w_ptr, logits_ptr, ids_ptr, weights_ptr, out_ptr, num_experts, N, K, stride_lm,
                        stride_am, stride_we, stride_wn, stride_om, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                        ROUTE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_TOPK)
    k_valid = ks < TOP_K
    slots = token * TOP_K + ks
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if ROUTE:
        picked, experts = _top_k(logits_ptr, token, num_experts, stride_lm, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_TOPK)
    else:
        wait_for_previous(PDL)
        experts = tl.load(ids_ptr + slots, mask=k_valid, other=0).to(tl.int64)
    n_mask = offs_n < N
    rows = (w_ptr + experts[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn)
    row_mask = k_valid[:, None, None] & n_mask[None, :, None]
    first_k = tl.arange(0, BLOCK_K)
    w_first = tl.load(rows + first_k[None, None, :], mask=row_mask & (first_k < K)[None, None, :], other=0.0)
    if ROUTE:
        wait_for_previous(PDL)
    else:
        picked = tl.load(weights_ptr + slots, mask=k_valid, other=0.0)
    a_rows = a_ptr + slots[:, None] * stride_am
    a_first = tl.load(a_rows + first_k[None, :], mask=k_valid[:, None] & (first_k < K)[None, :], other=0.0)
    acc = tl.sum(w_first.to(tl.float32) * a_first.to(tl.float32)[:, None, :], axis=2)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=k_valid[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(rows + offs_k[None, None, :], mask=row_mask & k_mask[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[:, None, :], axis=2)
    acc = acc * tl.where(k_valid, picked, 0.0)[:, None]
    dtype = out_ptr.dtype.element_ty
    out = tl.sum(acc.to(dtype).to(tl.float32), axis=0)
    tl.store(out_ptr + token * stride_om + offs_n, out.to(dtype), mask=n_mask)


def routed_experts(x, logits, w13, w2, top_k, renormalize, up_tile=(4, 2, 4), down_tile=(2, 256, 8), route_in_down=True):
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    per_sm, block_n, warps = up_tile
    total = top_k * I
    per_program = triton.cdiv(triton.cdiv(total, per_sm * num_sms(x.device)), block_n) * block_n
    grid = triton.cdiv(total, per_program)
    act = torch.empty(T * top_k, I, dtype=x.dtype, device=x.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    pdl = launch_options(x.device)
    be, bk = triton.next_power_of_2(E), triton.next_power_of_2(top_k)
    _gate_up_routed_kernel[(T, grid)](logits, x, w13, act, weights, ids, E, I, H, logits.stride(0), x.stride(0),
                                      w13.stride(0), w13.stride(1), act.stride(0), per_program, TOP_K=top_k,
                                      RENORMALIZE=renormalize, BLOCK_E=be, BLOCK_TOPK=bk, BLOCK_N=block_n,
                                      BLOCK_H=triton.next_power_of_2(H), num_warps=warps, **pdl)
    dn, dk, dw = down_tile
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    _down_routed_kernel[(T, triton.cdiv(H, dn))](act, w2, logits, ids, weights, out, E, H, I, logits.stride(0),
                                                 act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), TOP_K=top_k,
                                                 RENORMALIZE=renormalize, ROUTE=route_in_down, BLOCK_E=be,
                                                 BLOCK_TOPK=bk, BLOCK_N=dn, BLOCK_K=dk, num_warps=dw, **pdl)
    return out


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    E, H, I, K, L = 128, 2048, 768, 8, 8
    layers = [(torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.02,
               torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02,
               torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(L)]
    x0 = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    # correctness vs reference
    wr, w13, w2 = layers[0]
    logits = gemv(x0, wr, None, (4, 2, 4, "stream"))
    ref_w, ref_i = route(logits, K, True)
    ref = fused_experts_reference(x0, w13, w2, ref_w, ref_i)
    for rid in (True, False):
        out = routed_experts(x0, logits, w13, w2, K, True, route_in_down=rid)
        print("max diff", rid, (out.float() - ref.float()).abs().max().item(), ref.float().abs().max().item())
    base = _few_token_experts(x0, w13, w2, ref_w, ref_i, None, None, ((1, 1024, 1), (2, 256, 8)))
    print("base diff", (base.float() - ref.float()).abs().max().item())

    def chain(variant):
        x = x0
        for wr, w13, w2 in layers:
            logits = gemv(x, wr, None, (4, 2, 4, "stream"))
            if variant[0] == "base":
                w, i = route(logits, K, True)
                x = _few_token_experts(x, w13, w2, w, i, None, None, ((1, 1024, 1), (2, 256, 8)))
            else:
                x = routed_experts(x, logits, w13, w2, K, True, variant[1], variant[2], variant[3])
        return x
    variants = [("base",), ("routed", (4, 2, 4), (2, 256, 8), True), ("routed", (4, 2, 4), (2, 256, 8), False),
                ("routed", (8, 2, 4), (2, 256, 8), True), ("routed", (4, 4, 4), (2, 256, 8), True),
                ("routed", (8, 1, 2), (2, 256, 8), True), ("routed", (4, 2, 8), (2, 256, 8), True),
                ("routed", (16, 1, 1), (2, 256, 8), True), ("routed", (2, 4, 8), (2, 256, 8), True)]
    graphs = {}
    for v in variants:
        for _ in range(3):
            chain(v)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain(v)
        graphs[v] = g
    res = {v: [] for v in variants}
    for rnd in range(5):
        for v in variants:
            g = graphs[v]
            g.replay(); torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(50):
                g.replay()
            e.record(); torch.cuda.synchronize()
            res[v].append(s.elapsed_time(e) * 1e3 / 50 / L)
    for v in variants:
        r = sorted(res[v])
        print(v, "us per layer (router + moe): median %.2f min %.2f" % (r[len(r) // 2], r[0]))


main()
