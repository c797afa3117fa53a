"""Swap-to-CPU vs recompute preemption: throughput of long sequences under a KV pool too small for them.

    python bench/swap_bench.py --out bench/results          # H100: dummy Llama-3-8B, 32 x 4096 -> 256
    python bench/swap_bench.py --device cpu --quick --out /tmp/s   # smoke: the default model, tiny sizes

One engine (preemption_mode="swap", so the pinned CPU pool exists; prefix caching off) runs the same load alternately with the
scheduler's preemption mode set to recompute and to swap; the pool holds about a third of the load, so
sequences are preempted over and over. Also measured, for the cost rule (ARCHITECTURE.md, "Swap"): pinned
host<->device copy bandwidth and the prefill time per token, giving the per-token cost of a swap (KV bytes
out and back in over PCIe) against that of a recompute. Writes swap_<gpu>.json.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import add_engine_bench_args, device_slug, engine_bench_model, print_table, run_metadata, write_json  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_bench_args(parser)
    parser.add_argument("--quick", action="store_true", help="6 x 64 -> 16, one repeat (the smoke test)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each mode")
    parser.add_argument("--seqs-fit", type=int, default=None, help="prompts the KV pool holds at once (default: a "
                        "third of the requests); the pool has just a few blocks more, so decodes must preempt")
    parser.add_argument("--swap-space", type=float, default=24, help="GiB of pinned CPU memory")
    parser.add_argument("--swap-min-tokens", type=int, default=None, help="override the cost rule's threshold")
    args = parser.parse_args(argv)
    args.model = engine_bench_model(args)
    args.num_requests, args.input_len, args.output_len = (6, 64, 16) if args.quick else (32, 4096, 256)
    args.seqs_fit = args.seqs_fit or max(2, args.num_requests // 3)
    if args.quick:
        args.repeats, args.swap_space = 1, min(args.swap_space, 0.05)
    return args


def build_llm(args):
    from minivllm import LLM
    block_size = 16
    prompt_blocks = -(-args.input_len // block_size)
    # Half a prompt of slack: the running sequences' growth outruns it, so preemption must happen (with a
    # slack of seqs_fit // 2 blocks on the H100 the scheduler admitted one prompt fewer and never preempted).
    num_blocks = max(args.seqs_fit * prompt_blocks + prompt_blocks // 2,
                     -(-(args.input_len + args.output_len + 16) // block_size))
    options = dict(seed=0, device=args.device, max_num_seqs=args.num_requests, max_num_batched_tokens=8192,
                   max_model_len=args.input_len + args.output_len + 16, block_size=block_size,
                   num_gpu_blocks_override=num_blocks,
                   preemption_mode="swap", swap_space=args.swap_space, skip_tokenizer_init=True,
                   # Off: with it, the timed prefill and every run after the first hit the cache, and a
                   # recomputed victim finds its own freed blocks (the first H100 run measured that).
                   enable_prefix_caching=False)
    if args.model != "default":
        options.update(model=args.model, load_format="dummy")
    if args.device == "cpu":
        options["kv_cache_memory"] = 256 << 20
    return LLM(**options)


def copy_bandwidth(device: torch.device, num_bytes: int = 512 << 20) -> dict:
    """Pinned host -> device and device -> host bytes/s (the swap-in and swap-out directions)."""
    if device.type != "cuda":
        return {"h2d_bytes_per_s": None, "d2h_bytes_per_s": None}
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    result = {}
    for name, dst, src in [("h2d_bytes_per_s", dev, host), ("d2h_bytes_per_s", host, dev)]:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        result[name] = 5 * num_bytes / (time.perf_counter() - started)
    return result


def run(llm, args, mode: str, prompts) -> dict:
    from minivllm import SamplingParams
    engine = llm.llm_engine
    engine.scheduler.config.preemption_mode = mode
    before = engine.get_stats()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    after = engine.get_stats()
    bm = engine.block_manager
    bm.check_integrity([], [])
    leaked = (bm.num_blocks - bm.num_free_blocks) + (bm.cpu_pool.num_blocks - bm.cpu_pool.num_free_blocks)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"mode": mode, "elapsed_s": elapsed, "output_tokens_per_s": num_out / elapsed,
            "total_tokens_per_s": (num_out + sum(map(len, prompts))) / elapsed,
            "preemptions": after.num_preemptions - before.num_preemptions,
            "swap_outs": after.num_swap_outs - before.num_swap_outs, "leaked_blocks": leaked,
            "outputs": [o.outputs[0].token_ids for o in outputs]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    llm = build_llm(args)
    engine = llm.llm_engine
    runner, config = engine.runner, engine.scheduler.config
    if args.swap_min_tokens is not None:
        config.swap_min_tokens = args.swap_min_tokens
    meta = run_metadata(runner.device)
    vocab = engine.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.input_len)] for _ in range(args.num_requests)]

    from minivllm import SamplingParams
    one = [{"prompt_token_ids": prompts[0]}]
    llm.generate(one, SamplingParams(max_tokens=1), use_tqdm=False)  # warm up
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    llm.generate(one, SamplingParams(max_tokens=1), use_tqdm=False)
    prefill_s_per_token = (time.perf_counter() - started) / args.input_len
    bandwidth = copy_bandwidth(runner.device)
    kv_bytes_per_token = runner.kv_cache_bytes / (runner.num_blocks * runner.block_size)
    swap_s_per_token = None
    if bandwidth["h2d_bytes_per_s"]:
        swap_s_per_token = kv_bytes_per_token * (1 / bandwidth["h2d_bytes_per_s"] + 1 / bandwidth["d2h_bytes_per_s"])

    rows = []
    for repeat in range(args.repeats):
        for mode in ("recompute", "swap"):
            result = run(llm, args, mode, prompts)
            rows.append({"repeat": repeat, **result})
            print({k: v for k, v in rows[-1].items() if k != "outputs"}, flush=True)
    by_mode = {m: statistics.median(r["output_tokens_per_s"] for r in rows if r["mode"] == m)
               for m in ("recompute", "swap")}
    reference = rows[0]["outputs"]
    identical = [sum(a == b for a, b in zip(reference, r["outputs"])) for r in rows]
    for row in rows:
        row.pop("outputs")
    result = {**meta, "model": args.model, "num_requests": args.num_requests, "input_len": args.input_len,
              "output_len": args.output_len, "num_gpu_blocks": runner.num_blocks, "num_cpu_blocks": runner.num_cpu_blocks,
              "block_size": runner.block_size, "swap_min_tokens": config.swap_min_tokens,
              "kv_bytes_per_token": kv_bytes_per_token, **bandwidth, "prefill_s_per_token": prefill_s_per_token,
              "swap_s_per_token": swap_s_per_token,
              "recompute_output_tokens_per_s": by_mode["recompute"], "swap_output_tokens_per_s": by_mode["swap"],
              "swap_speedup": by_mode["swap"] / by_mode["recompute"],
              "outputs_identical_to_first_run": identical, "runs": rows}
    write_json(args.out / f"swap_{device_slug(meta['device'])}.json", result)
    print_table(rows, "swap vs recompute")
    print({k: result[k] for k in ("kv_bytes_per_token", "prefill_s_per_token", "swap_s_per_token", "swap_speedup")})
    return result


if __name__ == "__main__":
    main()
