"""Attention kernel benchmark: our Triton paged kernels (and, for prompts and chunks, the Hopper
Gluon kernel) against torch SDPA (and flex_attention when it compiles) on the same shapes, related to
what the hardware can do.

Decode is memory-bound, so it reports achieved GB/s (K/V bytes read / time) next to the device's
copy bandwidth (bytes read + written by a large device-to-device copy); prefill is compute-bound, so
it reports TFLOP/s over the causally visible query-key pairs. The verification shape (k + 1 = 6
queries per sequence after a long context, as speculative decoding scores drafts) reports both, and
every minivllm prefill/verify row carries `of_sdpa`, the fastest SDPA row's time over its own. Times are medians from
triton.testing.do_bench (which flushes L2 between runs). SDPA and flex read contiguous, unpaged K/V:
they are the "no paging" bar, not the same memory access pattern.

    python bench/kernels/attention_bench.py [--quick] [--out bench/results]
    python bench/kernels/attention_bench.py --tp-ranks 1,2,4 --out DIR    # decode only, one rank's heads

`--tp-ranks` times decode alone at W1's shape in steady decoding (64 sequences, 640-token contexts) with the
heads one tensor-parallel rank of Llama-3-8B holds at each size (32/8 query/KV heads at 1, 16/4 at 2, 8/2 at
4): a rank's attention should take its share of the KV bytes at the same GB/s.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # run from a checkout, uninstalled
from bench.common import device_slug, git_commit, run_command  # noqa: E402

DTYPE = torch.bfloat16
BLOCK_SIZE = 16
MAX_NUM_SEQS = 256   # the engine's default: mixed CUDA graphs pad their sequence count to it


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer shapes and repetitions, no flex_attention (it compiles slowly)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for attention_bench_<gpu>.json (not written when omitted)")
    parser.add_argument("--no-flex", action="store_true", help="skip flex_attention")
    parser.add_argument("--tp-ranks", default=None,
                        help="decode only, with one rank's heads at these tensor-parallel sizes (e.g. 1,2,4)")
    return parser.parse_args(argv)


def time_ms(fn, quick: bool) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median")


def copy_bandwidth(quick: bool) -> dict:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read and written."""
    numel = (1 << 30) // 2
    src = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), quick)
    nbytes = 2 * src.numel() * src.element_size()
    return {"kind": "copy", "impl": "torch copy_", "bytes": nbytes, "ms": ms,
            "gb_per_s": nbytes / ms / 1e6}


def paged_cache(batch: int, context: int, num_kv_heads: int, head_dim: int):
    """A cache holding `batch` contexts of `context` tokens in shuffled blocks, and their tables."""
    blocks_per_seq = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=DTYPE, device="cuda")
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    return k_cache, v_cache, block_tables


def contiguous_kv(k_cache, v_cache, block_tables, context):
    """The same contexts as [batch, kv_heads, context, head_dim] for SDPA / flex."""
    def gather(cache):
        blocks = cache[block_tables.long()]                       # [B, nb, bs, KVH, D]
        return blocks.flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    return gather(k_cache), gather(v_cache)


def graphed(fn):
    """`fn` captured in a CUDA graph, as the runner replays decode: times the kernels without the
    Python launch overhead, which dominates at small shapes."""
    graph = None

    def replay():
        nonlocal graph
        if graph is None:   # captured on first use, so a failure is reported like any other
            fn()            # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        graph.replay()
    return replay


def try_flex(enabled: bool):
    if not enabled:
        return None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def bench_decode(batch, context, num_heads, num_kv_heads, head_dim, quick, flex):
    from minivllm.kernels import choose_decode_splits, paged_decode_attention
    from minivllm.kernels.decode_attention import _num_sms
    k_cache, v_cache, block_tables = paged_cache(batch, context, num_kv_heads, head_dim)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, num_heads, head_dim, dtype=DTYPE, device="cuda")
    scale = head_dim ** -0.5
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * k_cache.element_size()
    splits = choose_decode_splits(batch, num_kv_heads, block_tables.shape[1] * BLOCK_SIZE, _num_sms(query.device))
    shape = {"batch": batch, "context": context, "num_heads": num_heads,
             "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": str(DTYPE)}
    rows = []

    def record(impl, fn):
        try:
            ms = time_ms(fn, quick)
        except Exception as error:  # a baseline that does not run here is reported, not fatal
            rows.append({"kind": "decode", "impl": impl, **shape, "error": repr(error)[:200]})
            return
        rows.append({"kind": "decode", "impl": impl, **shape, "ms": ms, "bytes": kv_bytes,
                     "gb_per_s": kv_bytes / ms / 1e6})

    def ours():
        return paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)

    record(f"minivllm triton (splits={splits})", ours)
    record(f"minivllm triton (splits={splits}) graph", graphed(ours))
    if splits is None:
        record("minivllm triton (forced split 1024)", lambda: paged_decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale, partition_size=1024))
    k, v = contiguous_kv(k_cache, v_cache, block_tables, context)
    q = query.unsqueeze(2)                                          # [B, H, 1, D]
    record("torch sdpa (contiguous, enable_gqa)", lambda: F.scaled_dot_product_attention(
        q, k, v, scale=scale, enable_gqa=True))
    if flex is not None:
        flex_attention, _ = flex
        record("flex_attention (contiguous)", lambda: flex_attention(q, k, v, scale=scale,
                                                                     enable_gqa=True))
    return rows


def paged_queries(batch, context, query_len, num_heads, num_kv_heads, head_dim):
    """Paged caches of `batch` contexts and queries for each one's last `query_len` tokens, as the
    prefill kernel takes them: (query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)."""
    k_cache, v_cache, block_tables = paged_cache(batch, context, num_kv_heads, head_dim)
    num_tokens = batch * query_len
    query = torch.randn(num_tokens, num_heads, head_dim, dtype=DTYPE, device="cuda")
    query_start_loc = torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return query, k_cache, v_cache, query_start_loc, seq_lens, block_tables


def step_kv(k: torch.Tensor, v: torch.Tensor, query_len: int):
    """This step's K/V as the attention layer hands them to the backend ([tokens, kv_heads, dim], each
    token's heads packed, as in the split of the qkv projection): the last `query_len` positions of the
    [batch, kv_heads, context, dim] contexts."""
    def rows(x):
        return x[:, :, -query_len:].transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).contiguous()
    return rows(k), rows(v)


def recorder(rows, kind, shape, quick, measures):
    """record(impl, fn): times `fn` and appends a row with `measures(ms)`, or the error it raised
    (a baseline that does not run here is reported, not fatal)."""
    def record(impl, fn):
        try:
            ms = time_ms(fn, quick)
        except Exception as error:
            rows.append({"kind": kind, "impl": impl, **shape, "error": repr(error)[:200]})
            return
        rows.append({"kind": kind, "impl": impl, **shape, "ms": ms, **measures(ms)})
    return record


def bench_prefill(batch, context, query_len, num_heads, num_kv_heads, head_dim, quick, flex):
    """`batch` sequences computing their last `query_len` of `context` tokens: fresh prompts when the
    two are equal, else a chunk after a cached prefix (a later chunk of a long prompt, a prefix hit)."""
    from minivllm.kernels import paged_prefill_attention
    from minivllm.kernels import prefill_attention_sm90 as sm90
    from torch.nn.attention.bias import causal_lower_right
    inputs = paged_queries(batch, context, query_len, num_heads, num_kv_heads, head_dim)
    query, k_cache, v_cache, query_start_loc, seq_lens, block_tables = inputs
    scale = head_dim ** -0.5
    # Two matmuls of 2 flops per multiply-add over the causally visible (query, key) pairs.
    pairs = batch * sum(context - query_len + i + 1 for i in range(query_len))
    flops = 4 * num_heads * head_dim * pairs
    shape = {"batch": batch, "query_len": query_len, "num_heads": num_heads,
             "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": str(DTYPE)}
    if context != query_len:
        shape["context"] = context
    rows = []
    record = recorder(rows, "prefill", shape, quick,
                      lambda ms: {"flops": flops, "tflop_per_s": flops / ms / 1e9})

    k, v = contiguous_kv(k_cache, v_cache, block_tables, context)
    key, value = step_kv(k, v, query_len)
    plan = sm90.plan_query_tiles(query_start_loc, seq_lens, query.shape[0])

    def engine():   # as the backend calls it: the Hopper kernel takes the long query runs where it runs
        return paged_prefill_attention(*inputs, scale, max_query_len=query_len, min_query_len=query_len,
                                       key=key, value=value, query_tile_plan=plan)

    def ours():   # the Triton kernel alone (any GPU; per-layer options; fp8 caches)
        return paged_prefill_attention(*inputs, scale, max_query_len=query_len, key=key, value=value)

    hopper = sm90.supported(query, key, value, k_cache, v_cache)
    engine_impl = "minivllm (Hopper kernel)" if hopper else "minivllm (no Hopper kernel here: Triton)"
    record(engine_impl, engine)
    record(f"{engine_impl} graph", graphed(engine))
    if hopper:   # the plan is built once per step and shared by every layer: its own row
        record("query-tile plan of the Hopper kernel (once per step) graph", graphed(
            lambda: sm90.plan_query_tiles(query_start_loc, seq_lens, query.shape[0])))
        padded = padded_step(inputs, key, value, MAX_NUM_SEQS)
        record(f"minivllm (Hopper kernel, {MAX_NUM_SEQS} sequences as a runner's graph pads them, plan "
               "included) graph", graphed(padded))
    record("minivllm triton (paged varlen)", ours)
    record("minivllm triton (paged varlen) graph", graphed(ours))
    record("minivllm triton (paged varlen, chunk from cache)", lambda: paged_prefill_attention(
        *inputs, scale, max_query_len=query_len))
    q = query.view(batch, query_len, num_heads, head_dim).transpose(1, 2).contiguous()
    if context == query_len:
        record("torch sdpa (causal, enable_gqa)", lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True))
    else:
        record("torch sdpa (causal lower-right, enable_gqa)", lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(query_len, context), scale=scale, enable_gqa=True))
    if flex is not None and context == query_len:
        flex_attention, create_block_mask = flex
        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                 query_len, query_len, device="cuda")
        record("flex_attention (causal block mask)", lambda: flex_attention(
            q, k, v, block_mask=mask, scale=scale, enable_gqa=True))
    return rows


def padded_step(inputs, key, value, max_num_seqs):
    """The engine's call inside a mixed CUDA graph: the sequence count padded to `max_num_seqs` with
    empty sequences (no query rows, no context) and the plan built in the same graph."""
    from minivllm.attention.metadata import AttentionMetadata
    from minivllm.attention.triton_backend import TritonAttentionBackend
    query, k_cache, v_cache, query_start_loc, seq_lens, block_tables = inputs
    batch = seq_lens.shape[0]
    padded_starts = torch.full((max_num_seqs + 1,), int(query_start_loc[-1]), dtype=torch.int32, device="cuda")
    padded_starts[:batch + 1] = query_start_loc
    padded_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device="cuda")
    padded_lens[:batch] = seq_lens
    padded_tables = torch.zeros(max_num_seqs, block_tables.shape[1], dtype=torch.int32, device="cuda")
    padded_tables[:batch] = block_tables
    backend = TritonAttentionBackend()
    scale = query.shape[-1] ** -0.5
    max_seq_len = int(seq_lens.max())

    def step():
        metadata = AttentionMetadata(slot_mapping=None, query_start_loc=padded_starts, seq_lens=padded_lens,
                                     block_tables=padded_tables, max_query_len=query.shape[0],
                                     max_seq_len=max_seq_len)
        return backend.attend(query, k_cache, v_cache, metadata, scale, key=key, value=value)
    return step


def bench_verify(batch, context, num_queries, num_heads, num_kv_heads, head_dim, quick):
    """k + 1 queries per sequence at the end of `context` tokens, through the paged prefill kernel."""
    from minivllm.kernels import paged_prefill_attention
    from torch.nn.attention.bias import causal_lower_right
    inputs = paged_queries(batch, context, num_queries, num_heads, num_kv_heads, head_dim)
    query, k_cache, v_cache, _, _, block_tables = inputs
    scale = head_dim ** -0.5
    pairs = batch * sum(context - num_queries + i + 1 for i in range(num_queries))
    flops = 4 * num_heads * head_dim * pairs
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * k_cache.element_size()
    shape = {"batch": batch, "context": context, "query_len": num_queries, "num_heads": num_heads,
             "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": str(DTYPE)}
    rows = []
    record = recorder(rows, "verify", shape, quick, lambda ms: {
        "flops": flops, "tflop_per_s": flops / ms / 1e9, "bytes": kv_bytes,
        "gb_per_s": kv_bytes / ms / 1e6})

    k, v = contiguous_kv(k_cache, v_cache, block_tables, context)
    key, value = step_kv(k, v, num_queries)

    def ours():
        return paged_prefill_attention(*inputs, scale, max_query_len=num_queries, key=key, value=value)

    record("minivllm triton (paged varlen)", ours)
    record("minivllm triton (paged varlen) graph", graphed(ours))
    record("minivllm triton (paged varlen, chunk from cache)", lambda: paged_prefill_attention(
        *inputs, scale, max_query_len=num_queries))
    q = query.view(batch, num_queries, num_heads, head_dim).transpose(1, 2).contiguous()
    record("torch sdpa (causal lower-right, enable_gqa)", lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(num_queries, context), scale=scale, enable_gqa=True))
    # The causal mask touches 15 of the 6 x 4096 pairs: unmasked SDPA costs the same work and may
    # take a faster kernel, so it is the bar as well.
    record("torch sdpa (no mask, enable_gqa)", lambda: F.scaled_dot_product_attention(
        q, k, v, scale=scale, enable_gqa=True))
    return rows


def relate_to_sdpa(rows: list[dict]) -> None:
    """Adds `of_sdpa` (fastest SDPA time / ours) to minivllm prefill and verify rows, per shape."""
    def key(row):
        return (row["kind"], row["batch"], row.get("context"), row["query_len"])
    best = {}
    for row in rows:
        if row["kind"] in ("prefill", "verify") and row["impl"].startswith("torch sdpa") and "ms" in row:
            best[key(row)] = min(best.get(key(row), float("inf")), row["ms"])
    for row in rows:
        if row["kind"] in ("prefill", "verify") and row["impl"].startswith("minivllm") and "ms" in row \
                and key(row) in best:
            row["of_sdpa"] = best[key(row)] / row["ms"]


def print_table(device: str, rows: list[dict]) -> None:
    print(f"device: {device}")
    header = f"{'kind':8} {'impl':44} {'shape':34} {'ms':>9} {'result':>14} {'of sdpa':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        if row["kind"] == "copy":
            shape = f"{row['bytes'] / 2**30:.0f} GiB read+written"
        elif row["kind"] == "verify":
            shape = (f"B{row['batch']} ctx{row['context']} q{row['query_len']} H{row['num_heads']}/"
                     f"{row['num_kv_heads']} D{row['head_dim']}")
        elif row["kind"] == "decode":
            shape = (f"B{row['batch']} ctx{row['context']} H{row['num_heads']}/"
                     f"{row['num_kv_heads']} D{row['head_dim']}")
        else:
            after = f" after {row['context'] - row['query_len']}" if "context" in row else ""
            shape = (f"{row['batch']}x{row['query_len']}{after} H{row['num_heads']}/"
                     f"{row['num_kv_heads']} D{row['head_dim']}")
        if "error" in row:
            print(f"{row['kind']:8} {row['impl']:44} {shape:34} {'-':>9} {'failed':>14}  {row['error']}")
            continue
        result = (f"{row['gb_per_s']:.0f} GB/s" if row["kind"] in ("copy", "decode", "verify")
                  else f"{row['tflop_per_s']:.1f} TFLOP/s")
        of_sdpa = f"{100 * row['of_sdpa']:.1f}%" if "of_sdpa" in row else ""
        print(f"{row['kind']:8} {row['impl']:44} {shape:34} {row['ms']:9.3f} {result:>14} {of_sdpa:>8}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    flex = try_flex(not (args.quick or args.no_flex))
    num_heads, num_kv_heads, head_dim = 32, 8, 128            # Llama-3-8B's attention
    decode_shapes = [(64, 4096)] if args.quick else [(64, 4096), (8, 4096), (1, 32768)]
    # (batch, context, query_len): fresh prompts, then chunks after a cached prefix
    prefill_shapes = [(8, 512, 512), (1, 4096, 4096), (1, 4096, 512), (8, 1024, 512)]
    verify_shapes = [(64, 4096, 6)]   # 64 sequences verifying k = 5 drafts (+ 1) after 4,096 tokens
    rows = [copy_bandwidth(args.quick)]
    if args.tp_ranks:   # one rank's heads at each size, W1's steady decode shape; nothing else
        decode_shapes, prefill_shapes, verify_shapes = [], [], []
        for ranks in (int(r) for r in args.tp_ranks.split(",")):
            rows += [dict(row, tp_ranks=ranks) for row in
                     bench_decode(64, 640, num_heads // ranks, num_kv_heads // ranks, head_dim, args.quick, flex)]
            torch.cuda.empty_cache()
    for batch, context in decode_shapes:
        rows += bench_decode(batch, context, num_heads, num_kv_heads, head_dim, args.quick, flex)
        torch.cuda.empty_cache()
    for batch, context, query_len in prefill_shapes:
        rows += bench_prefill(batch, context, query_len, num_heads, num_kv_heads, head_dim, args.quick, flex)
        torch.cuda.empty_cache()
    for batch, context, num_queries in verify_shapes:
        rows += bench_verify(batch, context, num_queries, num_heads, num_kv_heads, head_dim, args.quick)
        torch.cuda.empty_cache()
    relate_to_sdpa(rows)
    print_table(device, rows)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"device": device, "commit": git_commit(),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "torch": torch.__version__, "command": run_command(), "quick": args.quick, "block_size": BLOCK_SIZE,
                  "results": rows}
        path = args.out / f"attention_bench{'_tp' if args.tp_ranks else ''}_{device_slug(device)}.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
