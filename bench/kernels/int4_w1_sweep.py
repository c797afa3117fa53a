"""Where int4 (GPTQ layout, group 128) stands against bf16 cuBLAS on the Llama-3-8B layer shapes at the
sizes W1 runs (decode at M = 16-64, prefill chunks at M = 512-4096): the MMA tiles forming weights in fp32
(and the GEMV) against a sweep of those forming them two at a time in 16 bits (kernels/half_dequant.py), the
tuned dispatch the engine uses (tuning.pick over int4_gemm.candidates), and dequantize + cuBLAS.

    python bench/kernels/int4_w1_sweep.py --out bench/results [--ms 16,64] [--large-ms 128,512,4096] [--jobs 12]

Every candidate is checked against the fp32 reference, then timed from a CUDA graph (tuning.device_seconds);
the kernels are compiled first by `--jobs` worker processes (same shapes, so the same Triton cache entries).
Prints the best of each family per shape and M with its fraction of the copy bandwidth, then one layer's four
linears summed. Writes int4_w1_sweep_<device>.json.
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (announced_copy_bandwidth, checked_timing, device_slug, run_metadata,  # noqa: E402
                          write_json)
from bench.kernels.int4_gemv_sweep import random_int4  # noqa: E402
from bench.quant_bench import LAYERS_8B  # noqa: E402
from minivllm.kernels import int4_gemm  # noqa: E402
from minivllm.kernels.split_k import choose_split_k  # noqa: E402

GROUP = 128
WARPS_STAGES = ((4, 3), (4, 4), (8, 3))


def choices(M: int, N: int, K: int, sms: int) -> dict[str, list]:
    """Per family, (tile, split) pairs: the tiles with weights formed in fp32 (baseline: the candidates for
    fp32 x) and a sweep of those forming them in 16 bits (fast) over block sizes, warps and stages."""
    baseline = [c for c in int4_gemm.candidates(M, N, K, torch.device("cuda"), GROUP, 4, torch.float32)
                if c is not None]
    fast = []
    for block_m in ((16,) if M <= 16 else (16, 32, 64)):
        for n in (32, 64, 128, 256):
            for k in (64, 128):
                for warps, stages in WARPS_STAGES:
                    tile = int4_gemm.GemmConfig(block_m, n, k, warps, stages, True)
                    for fill in ((2, 4) if M <= 16 else (1, 2)):
                        fast.append((tile, choose_split_k(M, N, K, block_m, n, k, sms, fill)))
    return {"baseline": baseline, "fast": list(dict.fromkeys(fast))}


def _compile(jobs: list) -> None:
    """Worker: run each (K, N, M, config, split) once, filling the Triton cache."""
    device = torch.device("cuda")
    for K, N, M, config, split in jobs:
        qweight, scales, zeros = random_int4(K, N, device)
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        try:
            int4_gemm.weight_only_gemm(x, qweight, scales, zeros, GROUP, 4, split_k=split, config=config)
        except Exception:   # reported when the main process times it
            pass


def precompile(ms: list[int], workers: int, sms: int) -> None:
    jobs, seen = [], set()
    for _, K, N in LAYERS_8B:
        for M in ms:
            for family in choices(M, N, K, sms).values():
                for config, split in family:
                    key = (config, M % 16 == 0, split > 1)
                    if key not in seen:   # one compile per tile and specialization, not per shape
                        seen.add(key)
                        jobs.append((K, N, M, config, split))
        for M in (1, 2, 4, 8, 32):   # the other decode buckets the engine tunes: its candidates compiled too
            for choice in int4_gemm.candidates(M, N, K, torch.device("cuda"), GROUP, 4):
                if choice is not None and (choice[0], M % 16 == 0, choice[1] > 1) not in seen:
                    seen.add((choice[0], M % 16 == 0, choice[1] > 1))
                    jobs.append((K, N, M, *choice))
    print(f"compiling {len(jobs)} kernels in {workers} processes", flush=True)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile, [jobs[i::workers] for i in range(workers)])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--ms", default="16,64")
    parser.add_argument("--large-ms", default="128,512,4096")
    parser.add_argument("--jobs", type=int, default=12)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    meta = run_metadata(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ms = [int(m) for m in args.ms.split(",") if m]
    large_ms = [int(m) for m in args.large_ms.split(",") if m]
    precompile(ms, args.jobs, sms)
    copy_bw = announced_copy_bandwidth(device, meta)
    rows, best = [], {}
    for name, K, N in LAYERS_8B:
        qweight, scales, zeros = random_int4(K, N, device)
        weight_dense = int4_gemm.dequantize(qweight, scales, zeros, GROUP, 4, K).to(torch.bfloat16).t().contiguous()
        weight_bytes = qweight.numel() * 4 + 2 * scales.numel() * 2
        for M in ms + large_ms:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            reference = int4_gemm.weight_only_gemm_reference(x.float(), qweight, scales, zeros, GROUP, 4)
            moved = weight_bytes + M * (K + N) * 2

            def record(family, label, fn, check=True):
                timing = checked_timing(fn, reference if check else None, f"{name} M={M} {label}")
                if timing is None:
                    return
                error, seconds = timing
                row = {"family": family, "layer": name, "K": K, "N": N, "M": M, "candidate": label,
                       "us": 1e6 * seconds, "bytes_per_s": moved / seconds, "flops_per_s": 2 * M * K * N / seconds,
                       "max_rel_error": error, "correct": error < 2e-2}
                rows.append(row)
                if not row["correct"]:
                    print(f"  WRONG {name} M={M} {label}: rel error {error:.3g}", flush=True)
                elif (name, M, family) not in best or row["us"] < best[(name, M, family)]["us"]:
                    best[(name, M, family)] = row

            record("bf16", "cublas", lambda: torch.nn.functional.linear(x, weight_dense))
            record("dequant+cublas", "dequant+cublas",
                   lambda: x @ int4_gemm.dequantize_triton(qweight, scales, zeros, GROUP, 4, K, x.dtype))
            if M in large_ms:
                record("dequant_only", "dequantize_triton",
                       lambda: int4_gemm.dequantize_triton(qweight, scales, zeros, GROUP, 4, K, x.dtype), check=False)
                continue
            record("tuned", "weight_only_gemm (tuning.pick)",
                   lambda: int4_gemm.weight_only_gemm(x, qweight, scales, zeros, GROUP, 4))
            for family, family_choices in choices(M, N, K, sms).items():
                for config, split in family_choices:
                    record(family, f"{config}/split{split}",
                           lambda c=config, s=split: int4_gemm.weight_only_gemm(x, qweight, scales, zeros, GROUP, 4,
                                                                               split_k=s, config=c))
            ranked = sorted((r for r in rows if r["layer"] == name and r["M"] == M and r["correct"]),
                            key=lambda r: r["us"])
            print(f"{name} M={M}: " + "; ".join(f"{r['candidate']} {r['us']:.1f}" for r in ranked[:4]), flush=True)
        del weight_dense
        write_json(args.out / f"int4_w1_sweep_{device_slug(meta['device'])}.json",
                   {**meta, "copy_bandwidth_bytes_per_s": copy_bw, "rows": rows})
    print(f"\n{'layer':<13}{'M':>5} {'family':>15} {'us':>8} {'of copy':>8}  candidate")
    table = []
    for (name, M, family), row in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        fraction = row["bytes_per_s"] / copy_bw
        table.append({"layer": name, "M": M, "family": family, "us": row["us"], "candidate": row["candidate"],
                      "copy_fraction": fraction})
        print(f"{name:<13}{M:>5} {family:>15} {row['us']:8.1f} {fraction:8.2f}  {row['candidate']}")
    print("\none layer's four linears (us, best of each family):")
    for M in ms + large_ms:
        families = sorted({k[2] for k in best if k[1] == M})
        line = {f: sum(best[(n, M, f)]["us"] for n, _, _ in LAYERS_8B if (n, M, f) in best) for f in families}
        print(f"  M={M:>5}: " + "  ".join(f"{f} {us:.1f}" for f, us in line.items()))
    result = {**meta, "copy_bandwidth_bytes_per_s": copy_bw, "best": table, "rows": rows}
    write_json(args.out / f"int4_w1_sweep_{device_slug(meta['device'])}.json", result)
    return result


if __name__ == "__main__":
    main()
