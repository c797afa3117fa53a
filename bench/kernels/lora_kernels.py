"""What the batched LoRA kernels (kernels/lora.py) add to the base GEMMs they ride on, per Llama-3-8B layer.

Each case times one layer's four projections (qkv, o, gate_up, down; rank 16, 8 adapter slots, bf16) three ways,
from CUDA graphs that walk through 32 layers' weights in turn (so weights come from HBM, as in a decode step):
the base GEMMs alone; base GEMM + shrink + expand (the path for quantized weights); and the stacked GEMM (every
slot's A under the weight, lora/layers.py) + expand, the dense layers' path. Cases: one decode row
(single stream), 64 decode rows spread evenly over 8 adapters (W1's decode steps), 4,096 prompt rows over 8
adapters (W1's prefill chunks). The floor is the adapter bytes the step must read (A and B of each used slot),
over the copy bandwidth measured in the same run. The LoRA columns are each path's time less the base GEMMs'.

    python bench/kernels/lora_kernels.py --out DIR      # -> lora_kernels_<gpu>.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (device_slug, measure_copy_bandwidth, print_table, run_metadata,  # noqa: E402
                          write_json)
from minivllm.lora.layers import LoRABatch  # noqa: E402
from minivllm.kernels.tuning import device_seconds  # noqa: E402

LAYERS, HIDDEN, INTERMEDIATE, KV, RANK, SLOTS = 32, 4096, 14336, 1024, 16, 8
# (name, K, slice widths) of Llama-3-8B's packed projections
PROJECTIONS = (("qkv", HIDDEN, (HIDDEN, KV, KV)), ("o", HIDDEN, (HIDDEN,)),
               ("gate_up", HIDDEN, (INTERMEDIATE, INTERMEDIATE)), ("down", INTERMEDIATE, (HIDDEN,)))
CASES = (("single", 1, 1), ("w1_decode", 64, 8), ("w1_prefill", 4096, 8))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(device)
    dtype = torch.bfloat16
    widths_of = {name: widths for name, _, widths in PROJECTIONS}
    layers = []
    for _ in range(LAYERS):
        layer = {}
        for name, k, widths in PROJECTIONS:
            n, sr = sum(widths), len(widths) * RANK
            stacked = torch.randn(n + SLOTS * sr, k, device=device, dtype=dtype) / k ** 0.5
            a = stacked[n:].view(SLOTS, sr, k).transpose(1, 2).contiguous()   # the same A, as the shrink reads it
            b = torch.randn(SLOTS, RANK, n, device=device, dtype=dtype) * 0.01
            layer[name] = (stacked[:n], a, b, stacked)
        layers.append(layer)
    rows = []
    for case, num_tokens, used_slots in CASES:
        batch = LoRABatch(num_tokens, SLOTS, device)
        batch.set_mapping(np.arange(num_tokens) % used_slots)   # rows spread evenly over the used slots
        xs = {name: torch.randn(num_tokens, k, device=device, dtype=dtype) for name, k, _ in PROJECTIONS}
        names = tuple(name for name, _, _ in PROJECTIONS)

        def base(only=names):
            for layer in layers:
                for name in only:
                    F.linear(xs[name], layer[name][0])

        def separate(only=names):
            for layer in layers:
                for name in only:
                    weight, a, b, _ = layer[name]
                    batch.add_lora(F.linear(xs[name], weight), xs[name], a, b, widths_of[name])

        def stacked(only=names):
            for layer in layers:
                for name in only:
                    weight, _, b, full = layer[name]
                    out = F.linear(xs[name], full)
                    batch.expand_stacked(out[:, :weight.shape[0]], out[:, weight.shape[0]:], b, widths_of[name])

        def per_layer_us(fn, *only) -> float:
            return device_seconds(lambda: fn(*only), calls=2, repeats=10) / LAYERS * 1e6
        base_us = per_layer_us(base)
        adapter_bytes = sum((a[0].nbytes + b[0].nbytes) * used_slots for _, a, b, _ in layers[0].values())
        row = {"case": case, "rows": num_tokens, "adapters": used_slots, "base_gemms_us_per_layer": base_us,
               "separate_lora_us_per_layer": per_layer_us(separate) - base_us,
               "stacked_lora_us_per_layer": per_layer_us(stacked) - base_us,
               "floor_us_per_layer": adapter_bytes / bandwidth * 1e6}
        for name in names:
            one_base = per_layer_us(base, (name,))
            row[f"{name}_separate_us"] = per_layer_us(separate, (name,)) - one_base
            row[f"{name}_stacked_us"] = per_layer_us(stacked, (name,)) - one_base
        rows.append(row)
    print_table(rows, "LoRA kernels per Llama-3-8B layer (rank 16, 8 slots, bf16)")
    result = {**run_metadata(device), "copy_bandwidth_bytes_per_s": bandwidth, "rank": RANK, "slots": SLOTS,
              "cases": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / f"lora_kernels_{device_slug(result['device'])}.json", result)
    return result


if __name__ == "__main__":
    main()
