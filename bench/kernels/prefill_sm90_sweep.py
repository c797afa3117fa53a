"""Launch-config sweep of the Hopper fresh-prompt attention kernel (`kernels/prefill_attention_sm90`)
at the attention benchmark's prefill shapes (8 x 512, 1 x 4,096; 32 / 8 heads, head_dim 128, bf16):
each config is checked against SDPA on ragged prompts first, then timed beside SDPA (cuDNN) and the
Triton kernel's table choice. Prints a table; with --out writes prefill_sm90_sweep_<gpu>.json.

    python bench/kernels/prefill_sm90_sweep.py [--out DIR] [--configs 128x2,64x3]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # run from a checkout, uninstalled
from bench.common import device_slug, git_commit, run_command  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def time_ms(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def ragged(lengths, device="cuda", dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    starts = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device=device, dtype=torch.int32)
    return q, k, v, starts


def sdpa_ragged(q, k, v, starts, scale):
    out = torch.empty_like(q)
    bounds = starts.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                           v[a:b].transpose(0, 1), is_causal=True, scale=scale,
                                           enable_gqa=True)
        out[a:b] = o.transpose(0, 1)
    return out


def fresh_prompts_kernel(q, k, v, starts):
    """The Hopper kernel on fresh prompts (no prefix: a one-page cache it never reads), every sequence
    planned: (q, k, v, scale, **launch options) -> output."""
    from minivllm.kernels import prefill_attention_sm90 as sm90
    lens = starts[1:] - starts[:-1]
    cache = torch.zeros(1, 16, k.shape[1], k.shape[2], dtype=k.dtype, device=k.device)
    tables = torch.zeros(lens.shape[0], 1, dtype=torch.int32, device=k.device)
    plan = sm90.plan_query_tiles(starts, lens, q.shape[0], min_query_len=1)
    return lambda q, k, v, scale, **options: sm90.prefill_attention(q, k, v, cache, cache, tables, plan, scale,
                                                                     **options)


def main() -> None:
    from minivllm.kernels.prefill_attention import paged_prefill_attention
    from bench.kernels.attention_bench import paged_queries

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--configs", default="128x2x132,128x2x264,128x2x0,64x2x132,64x3x132,64x4x132",
                        help="BLOCK_N x STAGES x PROGRAMS (0: one program per query tile)")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    scale = HEAD_DIM ** -0.5
    rows = []

    lengths = [1, 17, 64, 65, 127, 128, 129, 300, 512, 1000, 2049]
    q, k, v, starts = ragged(lengths)
    want = sdpa_ragged(q, k, v, starts, scale)
    fresh_prefill_attention = fresh_prompts_kernel(q, k, v, starts)
    good = {}
    for block_n, stages, programs in configs:
        try:
            got = fresh_prefill_attention(q, k, v, scale, block_n=block_n, stages=stages,
                                          programs=programs or 1 << 30)
            torch.cuda.synchronize()
            err = (got.float() - want.float()).abs().max().item()
            good[(block_n, stages, programs)] = err < 2e-2
        except Exception as exc:   # a config that does not compile or launch is reported, not fatal
            err, good[(block_n, stages, programs)] = repr(exc)[:300], False
        print(f"check {block_n}x{stages}x{programs}: max abs err {err}", flush=True)
        rows.append(dict(kind="check", block_n=block_n, stages=stages, programs=programs, lengths=lengths,
                         max_abs_err=err, ok=good[(block_n, stages, programs)]))

    for batch, query_len in [(8, 512), (1, 4096)]:
        q, k, v, starts = ragged([query_len] * batch, seed=1)
        fresh_prefill_attention = fresh_prompts_kernel(q, k, v, starts)
        pairs = batch * query_len * (query_len + 1) // 2
        flops = 4 * HEADS * HEAD_DIM * pairs
        qs = q.view(batch, query_len, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        ks = k.view(batch, query_len, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        vs = v.view(batch, query_len, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                                 enable_gqa=True))
        shape = dict(batch=batch, query_len=query_len)
        rows.append(dict(kind="prefill", impl="torch sdpa (causal, enable_gqa)", **shape, ms=sdpa_ms,
                         tflop_per_s=flops / sdpa_ms / 1e9))
        inputs = paged_queries(batch, query_len, query_len, HEADS, KV_HEADS, HEAD_DIM)
        triton_ms = time_ms(lambda: paged_prefill_attention(*inputs, scale, max_query_len=query_len,
                                                            key=k, value=v))
        rows.append(dict(kind="prefill", impl="minivllm triton (table)", **shape, ms=triton_ms,
                         of_sdpa=sdpa_ms / triton_ms))
        for block_n, stages, programs in configs:
            if not good[(block_n, stages, programs)]:
                continue
            ms = time_ms(lambda: fresh_prefill_attention(q, k, v, scale, block_n=block_n,
                                                         stages=stages, programs=programs or 1 << 30))
            rows.append(dict(kind="prefill", impl=f"gluon sm90 {block_n}x{stages}x{programs}", **shape, ms=ms,
                             tflop_per_s=flops / ms / 1e9, of_sdpa=sdpa_ms / ms))
        for r in rows:
            if r.get("kind") == "prefill" and r["batch"] == batch and r["query_len"] == query_len:
                print(f"{batch} x {query_len}  {r['impl']:<36} {r['ms']:.4f} ms  "
                      f"{r.get('of_sdpa', 1.0):.3f} of SDPA", flush=True)

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"prefill_sm90_sweep_{device_slug(torch.cuda.get_device_name())}.json").write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), commit=git_commit(),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch=torch.__version__, command=run_command(), results=rows), indent=2))


if __name__ == "__main__":
    main()
