"""Tile-shape sweep for the paged prefill/multi-query attention kernel on one GPU: a list of launch
configs (the best two again with the query chunk's keys read through the pages instead of this
step's contiguous K/V, and in launch order) and the current table's choice at the attention
benchmark's prefill shapes and its k+1-query verification shape, each checked against SDPA before
it is timed (SDPA's kernels are recorded too).
Prints a table per shape; with --out writes prefill_attention_sweep_<gpu>.json. Used to fill
`minivllm.kernels.prefill_attention._tile_config`.

    python bench/kernels/prefill_attention_sweep.py [--out DIR] [--old PATH_TO_OLD_prefill_attention.py]
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # run from a checkout, uninstalled
from bench.kernels.attention_bench import contiguous_kv, paged_queries, step_kv  # noqa: E402
from bench.common import device_slug, git_commit, run_command  # noqa: E402
from minivllm.kernels.prefill_attention import PrefillConfig, paged_prefill_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def time_ms(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def make_shape(batch, context, query_len):
    """Paged inputs whose last `query_len` of `context` tokens are queries, plus contiguous SDPA ones."""
    inputs = paged_queries(batch, context, query_len, HEADS, KV_HEADS, HEAD_DIM)
    query, k_cache, v_cache, _, _, block_tables = inputs
    k, v = contiguous_kv(k_cache, v_cache, block_tables, context)
    q = query.view(batch, query_len, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    scale = HEAD_DIM ** -0.5
    if query_len == context:
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,  # noqa: E731
                                                       enable_gqa=True)
    else:
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(query_len, context)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,  # noqa: E731
                                                       enable_gqa=True)
    pairs = batch * sum(context - query_len + i + 1 for i in range(query_len))
    key, value = step_kv(k, v, query_len)
    return dict(args=(*inputs, scale), step_kv=dict(key=key, value=value),
                sdpa=sdpa, flops=4 * HEADS * HEAD_DIM * pairs, query_len=query_len,
                bytes=2 * k_cache.numel() * k_cache.element_size())


def sdpa_kernels(fn) -> list[str]:
    """The CUDA kernels one SDPA call launches (which backend torch picked)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({event.key for event in prof.key_averages()
                   if event.device_type == torch.autograd.DeviceType.CUDA})[:4]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--old", type=Path, help="an older prefill_attention.py to time alongside")
    parser.add_argument("--configs", type=str, default=None,
                        help="only these configs, fields as PrefillConfig's, e.g. "
                        "'64,64,4,2;256,64,16,3,0,1,1,1' (then the best two with variants)")
    parser.add_argument("--shapes", type=str, default=None, help="only these shapes, e.g. '8x512,1x4096'")
    parser.add_argument("--budget", type=float, default=200,
                        help="seconds after which no more variants of the best two are run (0: none)")
    args = parser.parse_args()
    old = None
    if args.old and args.old.exists():
        spec = importlib.util.spec_from_file_location("old_prefill_attention", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    shapes = {"8x512": (8, 512, 512), "1x4096": (1, 4096, 4096), "64x4096ctx_6q": (64, 4096, 6)}
    # Prompt shapes: this step's keys from the contiguous K/V (contiguous_kv, the default), one
    # warpgroup on 64 rows or two on 128, then the best few again with the chunk read through the
    # pages and in launch order. The verification shape: its few-row tiles, both ways.
    big = [PrefillConfig(*c) for c in [
        (64, 32, 4, 2, True), (64, 64, 4, 2), (64, 64, 4, 2, True), (64, 64, 4, 3), (64, 128, 4, 2),
        (128, 32, 4, 2), (128, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3),
        (128, 64, 8, 2, True), (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 8, 3, True)]]
    small = [PrefillConfig(*c) for c in [
        (32, 128, 4, 3), (16, 128, 4, 3), (32, 128, 4, 2), (64, 128, 4, 3), (32, 64, 4, 3)]]
    baseline = {"8x512": PrefillConfig(64, 32, 4, 2, True, True, False),
                "1x4096": PrefillConfig(64, 64, 4, 2, contiguous_kv=False),
                "64x4096ctx_6q": PrefillConfig(32, 128, 4, 3, contiguous_kv=False)}
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    if args.configs:
        big = small = [PrefillConfig(*map(int, c.split(","))) for c in args.configs.split(";")]
    results = []
    started = time.time()
    for name, (batch, context, query_len) in shapes.items():
        shape = make_shape(batch, context, query_len)
        reference = shape["sdpa"]()
        sdpa_ms = time_ms(shape["sdpa"])
        rows = [{"shape": name, "impl": "sdpa", "ms": sdpa_ms, "kernels": sdpa_kernels(shape["sdpa"])}]
        if old is not None:
            rows.append({"shape": name, "impl": "old kernel", "ms": time_ms(
                lambda: old.paged_prefill_attention(*shape["args"], max_query_len=query_len))})

        def run(config):
            fn = lambda: paged_prefill_attention(*shape["args"], config=config,  # noqa: E731
                                                 **shape["step_kv"])
            try:
                out = fn()
                got = out.view(batch, query_len, HEADS, HEAD_DIM).transpose(1, 2).float()
                error = ((got - reference.float()).norm() / reference.float().norm()).item()
                row = {"shape": name, "impl": "new", "config": config._asdict(), "error": error}
                if not error < 2e-2:
                    row["failed"] = "wrong result"
                else:
                    row["ms"] = time_ms(fn)
            except Exception as exc:  # a config that does not compile (shared memory) is skipped
                row = {"shape": name, "impl": "new", "config": config._asdict(), "failed": repr(exc)[:160]}
            rows.append(row)
            return row

        configs = small if query_len <= 16 else big
        run(baseline[name])
        timed = [row for row in map(run, configs) if "ms" in row]
        best = sorted(timed, key=lambda r: r["ms"])[:2]
        for row in best:
            base = PrefillConfig(**row["config"])
            for variant in [dict(contiguous_kv=False), dict(heavy_first=False)]:
                if time.time() - started < args.budget:   # keep the whole sweep inside one device call
                    run(base._replace(**variant))
        for row in rows:
            if "ms" in row:
                row["tflop_per_s"] = shape["flops"] / row["ms"] / 1e9
                row["gb_per_s"] = shape["bytes"] / row["ms"] / 1e6
                row["of_sdpa"] = sdpa_ms / row["ms"]
        results += rows
        print(f"== {name}  (sdpa {sdpa_ms:.4f} ms, {shape['flops'] / sdpa_ms / 1e9:.0f} TFLOP/s,"
              f" {rows[0]['kernels']})"
              f"  elapsed {time.time() - started:.0f}s", flush=True)
        for row in sorted(rows, key=lambda r: r.get("ms", 1e9))[:16]:
            config = tuple(row["config"].values()) if "config" in row else ""
            if "ms" in row:
                print(f"{row['impl']:10} {str(config):52} {row['ms']:.4f} ms {row['tflop_per_s']:6.1f} TF"
                      f" {row['gb_per_s']:6.0f} GB/s {100 * row['of_sdpa']:5.1f}%", flush=True)
        failed = [row for row in rows if "failed" in row]
        print(f"failed: {len(failed)}", [(tuple(r['config'].values()), r['failed'][:60]) for r in failed[:4]])
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"prefill_attention_sweep_{device_slug(torch.cuda.get_device_name())}.json").write_text(json.dumps(
                {"device": torch.cuda.get_device_name(), "commit": git_commit(),
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "command": run_command(), "results": results}, indent=1))
        del shape, reference
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
