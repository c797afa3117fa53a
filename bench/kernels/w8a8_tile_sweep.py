"""The fp8 W8A8 GEMM at decode sizes: every candidate tile (kernels/w8a8_gemm.candidates) and a set of extra
ones (split-K at several fills, and narrow tiles unsplit), on the Llama-3-8B layer shapes, against bf16 cuBLAS
and the copy bandwidth.

    python bench/kernels/w8a8_tile_sweep.py --out bench/results [--ms 1,16]

Each candidate is checked against the reference (`w8a8_reference`) and timed from a CUDA graph
(tuning.device_seconds). Prints, per shape and M, the four fastest and whether each is among the engine's
candidates, then one layer's four linears summed for the engine's candidates alone and with the extras.
Writes w8a8_tile_sweep_<device>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (announced_copy_bandwidth, checked_timing, device_slug, run_metadata,  # noqa: E402
                          write_json)
from bench.quant_bench import LAYERS_8B  # noqa: E402
from minivllm.kernels import w8a8_gemm  # noqa: E402
from minivllm.kernels.quant_rows import quantize_rows  # noqa: E402
from minivllm.kernels.tuning import device_seconds  # noqa: E402

# (BLOCK_N, BLOCK_K, warps, stages): longer K steps and deeper pipelines than the M <= 16 candidates
EXTRA_TILES = ((64, 256, 4, 5), (128, 128, 4, 6), (64, 512, 4, 3), (32, 512, 4, 4), (32, 256, 4, 6),
               (64, 512, 4, 4), (128, 256, 4, 4), (32, 1024, 4, 3), (64, 256, 8, 4), (16, 512, 4, 4),
               (32, 512, 8, 4), (64, 128, 4, 8))


# unsplit (no partials to sum, no second kernel): narrow tiles, so that N alone gives about a program per SM
SPLIT_ONE_TILES = ((16, 512, 4, 4), (16, 1024, 4, 3), (16, 256, 4, 6), (16, 512, 2, 4), (32, 512, 4, 4),
                   (32, 1024, 4, 3), (32, 256, 4, 6), (32, 512, 2, 4), (64, 256, 4, 5), (64, 512, 4, 3))


def extra_candidates(M: int, N: int, K: int, device) -> list[w8a8_gemm.W8A8Tile]:
    block_m = w8a8_gemm.split_tiles(M, N, K, device, EXTRA_TILES[:1], (1,))[0].block_m
    return w8a8_gemm.split_tiles(M, N, K, device, EXTRA_TILES, (1, 2, 4, 8)) + [
        w8a8_gemm.W8A8Tile(block_m, *tile, split_k=1) for tile in SPLIT_ONE_TILES]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--ms", default="1")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    meta = run_metadata(device)
    copy_bw = announced_copy_bandwidth(device, meta)
    rows, best = [], {}
    for name, K, N in LAYERS_8B:
        generator = torch.Generator(device=device).manual_seed(0)
        weight = torch.randn(N, K, device=device, generator=generator, dtype=torch.bfloat16) * 0.02
        w_codes, w_scale = quantize_rows(weight, w8a8_gemm.FP8)
        w_scale = w_scale.view(-1)
        dense = weight.contiguous()
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            x_codes, x_scale = quantize_rows(x, w8a8_gemm.FP8)
            reference = w8a8_gemm.w8a8_reference(x_codes, x_scale, w_codes, w_scale, torch.float32)
            moved = N * K + N * 4 + M * K + M * N * 2
            seconds = device_seconds(lambda: torch.nn.functional.linear(x, dense), calls=10, repeats=10)
            best[(name, M, "bf16")] = {"us": 1e6 * seconds, "candidate": "cublas"}
            engine = [c for c in w8a8_gemm.candidates(M, N, K, device) if c is not None]
            for tile in list(dict.fromkeys(engine + extra_candidates(M, N, K, device))):
                def fn(tile=tile):
                    return w8a8_gemm.w8a8_triton(x_codes, x_scale, w_codes, w_scale, torch.bfloat16, tile)
                timing = checked_timing(fn, reference, f"{name} M={M} {tile}")
                if timing is None:
                    continue
                error, seconds = timing
                row = {"layer": name, "K": K, "N": N, "M": M, "candidate": str(tile), "engine": tile in engine,
                       "us": 1e6 * seconds, "bytes_per_s": moved / seconds, "copy_fraction": moved / seconds / copy_bw,
                       "max_rel_error": error, "correct": error < 2e-2}
                rows.append(row)
                if not row["correct"]:
                    print(f"  WRONG {name} M={M} {tile}: rel error {error:.3g}", flush=True)
                    continue
                for kind in ("all", "engine") if tile in engine else ("all",):
                    key = (name, M, kind)
                    if key not in best or row["us"] < best[key]["us"]:
                        best[key] = row
            ranked = sorted((r for r in rows if r["layer"] == name and r["M"] == M and r["correct"]),
                            key=lambda r: r["us"])
            print(f"{name} M={M}: engine best {best[(name, M, 'engine')]['us']:.1f} us; top: " + "; ".join(
                f"{r['candidate']}{' (engine)' if r['engine'] else ''} {r['us']:.1f} us "
                f"{r['copy_fraction']:.2f}" for r in ranked[:4]), flush=True)
        write_json(args.out / f"w8a8_tile_sweep_{device_slug(meta['device'])}.json",
                   {**meta, "copy_bandwidth_bytes_per_s": copy_bw, "rows": rows})
    summary = {}
    for M in sorted({k[1] for k in best}):
        summary[M] = {kind: sum(best[(n, M, kind)]["us"] for n, _, _ in LAYERS_8B)
                      for kind in ("bf16", "engine", "all")}
        print(f"one layer's four linears at M={M}: " + "  ".join(f"{k} {v:.1f} us" for k, v in summary[M].items()))
    result = {**meta, "copy_bandwidth_bytes_per_s": copy_bw, "layer_sum_us": summary, "rows": rows,
              "best": [{"layer": k[0], "M": k[1], "kind": k[2], "us": v["us"], "candidate": v["candidate"]}
                       for k, v in best.items()]}
    write_json(args.out / f"w8a8_tile_sweep_{device_slug(meta['device'])}.json", result)
    return result


if __name__ == "__main__":
    main()
