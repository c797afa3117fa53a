"""The int4 weight-only GEMM at decode sizes against a baseline build of the same module, bf16 cuBLAS and the
copy bandwidth, on the Llama-3-8B layer shapes (group 128), each candidate checked against the reference first.

    python bench/kernels/int4_gemv_sweep.py --out bench/results [--baseline PATH/TO/int4_gemm.py]

`--baseline` loads another version of kernels/int4_gemm.py (e.g. the main branch's) as "before"; every
candidate tile of both (kernels/int4_gemm.candidates, plus extra GEMV tiles for M = 1) is timed from a CUDA
graph (tuning.device_seconds). Prints, per shape and M, the best of each with us, TB/s (packed weights,
scales, zeros and activations) and the fraction of the measured copy bandwidth, then the four linears of
one layer summed. Tiles differing only in pipeline depth (STAGED_GEMV) are timed for a module whose kernel
takes STAGES; for a module with the packed-half kernel, that kernel's tiles at other depths (HALF_GEMV) instead. Writes int4_gemv_sweep_<device>.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (announced_copy_bandwidth, checked_timing, device_slug, run_metadata,  # noqa: E402
                          write_json)
from bench.quant_bench import LAYERS_8B  # noqa: E402
from minivllm.kernels import int4_gemm  # noqa: E402
from minivllm.kernels.tuning import device_seconds  # noqa: E402

GROUP = 128
EXTRA_GEMV = [int4_gemm.GemvConfig(*t) for t in
              ((512, 32, 1, 2), (512, 32, 1, 4), (1024, 32, 2, 3), (512, 64, 2, 3), (256, 64, 1, 3),
               (256, 32, 1, 3), (1024, 64, 4, 3), (256, 128, 2, 3), (512, 128, 4, 3), (128, 128, 1, 3),
               (2048, 32, 4, 3), (512, 32, 2, 3))]


# the K loop is pipelined `num_stages` deep since the kernel took a STAGES argument: the best tiles at other depths
STAGED_GEMV = [int4_gemm.GemvConfig(n, k, w, stages, fused_sum=True)
               for n, k, w in ((128, 128, 4), (256, 128, 4), (512, 64, 2), (512, 32, 2), (1024, 64, 4), (256, 64, 2),
                               (512, 128, 4), (1024, 32, 4), (256, 128, 8))
               for stages in (2, 4, 6)]


# the packed-half kernel (kernels/int4_gemv_half.py): its engine tiles at other pipeline depths, and wider ones
HALF_GEMV = [int4_gemm.GemvConfig(n, k, w, stages, fused_sum=True, half=True)
             for n, k, w in ((512, 64, 2), (1024, 64, 4), (1024, 32, 2), (512, 32, 1), (2048, 64, 8), (1024, 128, 4))
             for stages in (2, 4, 5)] if hasattr(int4_gemm, "HALF_GEMV_TILES") else []


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_int4(K: int, N: int, device, seed: int = 0):
    generator = torch.Generator(device=device).manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), device=device, dtype=torch.int32, generator=generator)
    scales = (torch.rand(K // GROUP, N, device=device, generator=generator) * 0.02 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (K // GROUP, N), device=device, generator=generator).to(torch.bfloat16)
    return qweight, scales, zeros


def choices(module, M, N, K, device):
    out = [c for c in module.candidates(M, N, K, device) if c is not None]
    if M == 1 and hasattr(module, "GemvConfig"):
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if hasattr(module, "HALF_GEMV_TILES"):   # the packed-half kernel's tiles at other depths and widths
            extra = HALF_GEMV
        else:
            staged = "STAGES" in module._int4_gemv_kernel.arg_names
            extra = EXTRA_GEMV + (STAGED_GEMV if staged else [])
        for tile in extra:
            for fill in (2, 4, 8):
                # the module's own class: its kernel tells tiles apart by isinstance
                fields = tile[:len(module.GemvConfig._fields)]   # a baseline's class may lack newer fields
                out.append((module.GemvConfig(*fields), module.choose_split_k(M, N, K, 1, tile.block_n, tile.block_k,
                                                                              sms, fill)))
    return [None] + list(dict.fromkeys(out))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--baseline", default=None, help="another int4_gemm.py to time as 'before'")
    parser.add_argument("--ms", default="1,16,64")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    meta = run_metadata(device)
    copy_bw = announced_copy_bandwidth(device, meta)
    versions = {"after": int4_gemm}
    if args.baseline:
        versions = {"before": load_module(args.baseline, "baseline_int4_gemm"), **versions}
    rows, best = [], {}
    for name, K, N in LAYERS_8B:
        qweight, scales, zeros = random_int4(K, N, device)
        weight_dense = int4_gemm.dequantize(qweight, scales, zeros, GROUP, 4, K).to(torch.bfloat16).t().contiguous()
        weight_bytes = qweight.numel() * 4 + 2 * scales.numel() * 2
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            reference = int4_gemm.weight_only_gemm_reference(x.float(), qweight, scales, zeros, GROUP, 4)
            moved = weight_bytes + M * (K + N) * 2
            seconds = device_seconds(lambda: torch.nn.functional.linear(x, weight_dense), calls=10, repeats=10)
            best[(name, M, "bf16")] = {"us": 1e6 * seconds, "candidate": "cublas",
                                       "bytes_per_s": (K * N * 2 + M * (K + N) * 2) / seconds}
            for version, module in versions.items():
                for choice in choices(module, M, N, K, device):
                    def fn(choice=choice, module=module):
                        if choice is None:
                            return x @ module.dequantize_triton(qweight, scales, zeros, GROUP, 4, K, x.dtype)
                        return module.weight_only_gemm(x, qweight, scales, zeros, GROUP, 4, split_k=choice[1],
                                                       config=choice[0])
                    label = "dequant+cublas" if choice is None else f"{choice[0]}/split{choice[1]}"
                    timing = checked_timing(fn, reference, f"{version} {name} M={M} {label}")
                    if timing is None:
                        continue
                    error, seconds = timing
                    row = {"version": version, "layer": name, "K": K, "N": N, "M": M, "candidate": label,
                           "us": 1e6 * seconds, "bytes_per_s": moved / seconds, "max_rel_error": error,
                           "correct": error < 2e-2}
                    rows.append(row)
                    key = (name, M, version)
                    if row["correct"] and (key not in best or row["us"] < best[key]["us"]):
                        best[key] = row
                    if not row["correct"]:
                        print(f"  WRONG {version} {name} M={M} {label}: rel error {error:.3g}", flush=True)
            ranked = sorted((r for r in rows if r["layer"] == name and r["M"] == M and r["version"] == "after"),
                            key=lambda r: r["us"])
            print(f"{name} M={M}: top after: " + "; ".join(f"{r['candidate']} {r['us']:.1f}" for r in ranked[:4]),
                  flush=True)
        del weight_dense
        write_json(args.out / f"int4_gemv_sweep_{device_slug(meta['device'])}.json",
                   {**meta, "copy_bandwidth_bytes_per_s": copy_bw, "rows": rows})
    print(f"\n{'layer':<13}{'M':>4} {'version':>8} {'us':>8} {'TB/s':>6} {'of copy':>8}  candidate")
    table = []
    for (name, M, version), row in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        fraction = row["bytes_per_s"] / copy_bw
        table.append({"layer": name, "M": M, "version": version, "us": row["us"], "candidate": row["candidate"],
                      "bytes_per_s": row["bytes_per_s"], "copy_fraction": fraction})
        print(f"{name:<13}{M:>4} {version:>8} {row['us']:8.1f} {row['bytes_per_s'] / 1e12:6.2f} {fraction:8.2f}  "
              f"{row['candidate']}")
    print("\none layer's four linears (us):")
    for M in sorted({k[1] for k in best}):
        line = {v: sum(best[(n, M, v)]["us"] for n, _, _ in LAYERS_8B if (n, M, v) in best)
                for v in ("bf16", *versions)}
        floor = sum(K * N / 2 + K // GROUP * N * 4 + M * (K + N) * 2 for _, K, N in LAYERS_8B) / copy_bw * 1e6
        print(f"  M={M:>3}: " + "  ".join(f"{v} {us:.1f}" for v, us in line.items()) + f"  int4 floor {floor:.1f}")
    result = {**meta, "copy_bandwidth_bytes_per_s": copy_bw, "best": table, "rows": rows}
    write_json(args.out / f"int4_gemv_sweep_{device_slug(meta['device'])}.json", result)
    return result


if __name__ == "__main__":
    main()
