"""Decode attention's split-K partition size at small batch, timed as the engine runs it: 32 layers' caches
(so the keys come from HBM, not L2) called in turn from one CUDA graph, Llama-3-8B's heads (32 query, 8 KV,
head_dim 128, bf16). Rows: batch x actual context x the graph's longest context (the block-table width),
for the partition a rule without the long-partition floor chose (per-sequence partitions from one key tile up
until two programs a SM, however many (sequence, KV head) programs there are), the current rule
(`choose_decode_splits`, `shortest_partition`, `sequence_partition_size`), fixed sizes, and no split.

    python bench/kernels/decode_split_sweep.py --out DIR      # -> decode_split_<gpu>.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import device_slug, run_metadata, write_json  # noqa: E402
from minivllm.kernels.decode_attention import (MIN_PARTITION_SIZE, choose_decode_splits,  # noqa: E402
                                              paged_decode_attention, sequence_partition_size, shortest_partition)
from minivllm.kernels.tuning import device_seconds  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 32, 8, 128, 16


def tile_floor_rule(batch: int, context: int, max_context: int, sms: int) -> int | None:
    """The partition of a rule that splits from one key tile up until two programs a SM, at any occupancy."""
    programs = batch * KV_HEADS
    if programs >= 2 * sms or max_context <= MIN_PARTITION_SIZE:
        return None
    splits = min(triton.cdiv(2 * sms, programs), triton.cdiv(max_context, MIN_PARTITION_SIZE))
    partition = sequence_partition_size(context, splits)
    return None if partition >= context else partition


def make_case(batch: int, context: int, max_context: int):
    blocks_per_seq = max_context // BLOCK
    num_blocks = batch * blocks_per_seq
    caches = [(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
               torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
              for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return caches, tables, seq_lens, query


def time_case(case, partition: int | str | None) -> float:
    """partition: tokens, "auto" (the current rule) or None (no split)."""
    caches, tables, seq_lens, query = case
    size = None if partition == "auto" else partition if partition is not None else 1 << 30

    def step():
        for k, v in caches:
            paged_decode_attention(query, k, v, tables, seq_lens, HEAD_DIM ** -0.5, partition_size=size)
    return device_seconds(step, calls=2, repeats=20) / LAYERS


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    meta = run_metadata(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch in (1, 4, 16, 17, 24, 32, 64):
        for context, max_context in ((600, 768), (600, 8192), (4000, 4096), (4000, 32768)):
            if batch * max_context * LAYERS * KV_HEADS * HEAD_DIM * 4 > 40e9:
                continue
            splits = choose_decode_splits(batch, KV_HEADS, max_context, sms)
            current = (sequence_partition_size(context, splits, shortest_partition(batch, KV_HEADS, sms))
                       if splits else None)
            current = None if current is not None and current >= context else current
            rules = {"tile floor": tile_floor_rule(batch, context, max_context, sms), "current rule": "auto"}
            sizes = dict(rules, **{str(p): p for p in (64, 128, 256, 512)}, **{"no split": None})
            times, case = {}, make_case(batch, context, max_context)
            for label, partition in sizes.items():
                times[label] = 1e6 * time_case(case, partition)
                rows.append({"batch": batch, "context": context, "max_context": max_context, "label": label,
                             "partition": current if partition == "auto" else partition,
                             "us_per_layer": times[label]})
            print(f"batch {batch:>3} context {context:>5} / {max_context:>6}: tile floor {rules['tile floor']} "
                  f"{times['tile floor']:.2f} us, current {current} {times['current rule']:.2f} us; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in times.items() if k not in rules), flush=True)
            del case
            torch.cuda.empty_cache()
    result = {**meta, "layers": LAYERS, "heads": [HEADS, KV_HEADS, HEAD_DIM], "rows": rows}
    if args.out:
        write_json(args.out / f"decode_split_{device_slug(meta['device'])}.json", result)
    return result


if __name__ == "__main__":
    main()
