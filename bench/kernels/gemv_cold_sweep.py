"""The int4 GEMV at M = 1 on the 8B layer shapes, every tile timed cold (H100).

    python bench/kernels/gemv_cold_sweep.py --out bench/results

A decode step reads each layer's weights from HBM; timing one weight over and over reads them from L2 for
any layer under 50 MB. Here each candidate's calls rotate through copies of the weights that exceed L2
(kernels/tuning.cold_copies), as the engine's tuner now times them. Candidates: the tuner's own
(int4_gemm.candidates) and narrow tiles (BLOCK_N 16-128) with few or no K splits, for both GEMV kernels:
fewer splits leave each program more K steps and the last slice fewer partials to sum. Each is checked
against the reference first. Prints the best five per layer and the tuner's best; writes
gemv_cold_sweep_<device>.json with every timing.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import device_slug, run_metadata, write_json  # noqa: E402
from bench.quant_bench import LAYERS_8B  # noqa: E402
from minivllm.kernels import int4_gemm  # noqa: E402
from minivllm.kernels.int4_gemv_tma import TmaGemvConfig, layout_split  # noqa: E402
from minivllm.kernels.tuning import cold_copies, device_seconds  # noqa: E402

GROUP = 128
NARROW = [int4_gemm.GemvConfig(n, k, w, 4, fused_sum=True, half=half)
          for (n, w), k, half in itertools.product(((16, 1), (16, 2), (32, 1), (32, 2), (32, 4), (64, 2), (64, 4),
                                                    (128, 4)), (64, 128), (False, True))]
NARROW_SPLITS = (1, 2, 4, 8)


def tma_sweep_tiles(half: bool = True) -> list:
    """The Gluon GEMV's tiles over width, rows and columns a thread, warps, groups a stage and programs an SM, the
    ring about 96 KB an SM; in packed-half arithmetic or fp32."""
    tiles = []
    for block_n, (columns, rows), groups, (per_sm, warps) in itertools.product(
            (16, 32, 64), ((4, 2), (4, 4), (8, 2), (8, 4)), (8, 16), ((1, 4), (1, 8), (2, 4))):
        stage_bytes = groups * GROUP // 8 * block_n * 4
        stages = max(2, min(8, (96 << 10) // per_sm // stage_bytes))
        tile = TmaGemvConfig(block_n, groups, stages, warps, columns, rows, per_sm, half)
        if layout_split(tile, GROUP // 8) is not None:
            tiles.append(tile)
    return tiles


def random_int4(K: int, N: int, device):
    generator = torch.Generator(device=device).manual_seed(0)
    qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), device=device, dtype=torch.int32, generator=generator)
    scales = (torch.rand(K // GROUP, N, device=device, generator=generator) * 0.02 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (K // GROUP, N), device=device, generator=generator).to(torch.bfloat16)
    return qweight, scales, zeros


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--no-narrow", action="store_true", help="leave out the narrow Triton tiles")
    parser.add_argument("--tma-sweep", choices=("half", "fp32"), help="add the Gluon GEMV's sweep (tma_sweep_tiles)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    result = {**run_metadata(device), "rows": [], "best": []}
    path = args.out / f"gemv_cold_sweep_{device_slug(result['device'])}.json"
    total = 0.0
    for name, K, N in LAYERS_8B:
        weights = random_int4(K, N, device)
        copies = cold_copies(weights)
        x = torch.randn(1, K, device=device).to(torch.bfloat16)
        reference = int4_gemm.weight_only_gemm_reference(x.float(), *weights, GROUP, 4)
        tuned = [(c, "tuner") for c in int4_gemm.candidates(1, N, K, device, GROUP, 4) if c is not None]
        narrow = [] if args.no_narrow else [((t, s), "narrow") for t in NARROW for s in NARROW_SPLITS]
        sweep = [((t, 1), "tma") for t in tma_sweep_tiles(args.tma_sweep == "half")] if args.tma_sweep else []
        timings = []
        for (config, split), origin in tuned + narrow + sweep:
            try:
                out = int4_gemm.weight_only_gemm(x, *weights, GROUP, 4, split_k=split, config=config)
                error = ((out.float() - reference).abs().max() / reference.abs().max()).item()
                if error > 2e-2:
                    print(f"  {name} {config}/split{split}: error {error:.3g}", flush=True)
                    continue
                turn = itertools.count()
                seconds = device_seconds(
                    lambda: int4_gemm.weight_only_gemm(x, *copies[next(turn) % len(copies)], GROUP, 4,
                                                       split_k=split, config=config),
                    calls=max(5, len(copies)), repeats=10)
            except Exception as e:   # a tile that does not fit (registers, shared memory)
                print(f"  {name} {config}/split{split}: {type(e).__name__}", flush=True)
                continue
            row = {"layer": name, "K": K, "N": N, "candidate": f"{config}/split{split}", "origin": origin,
                   "us": 1e6 * seconds}
            timings.append(row)
            result["rows"].append(row)
        timings.sort(key=lambda r: r["us"])
        best_tuner = next(r for r in timings if r["origin"] == "tuner")
        result["best"].append({"layer": name, "best": timings[0], "best_tuner_candidate": best_tuner})
        total += timings[0]["us"]
        print(f"{name}: tuner's best {best_tuner['us']:.2f} us {best_tuner['candidate']}", flush=True)
        for row in timings[:5]:
            print(f"   {row['us']:6.2f} us {row['origin']:>6} {row['candidate']}", flush=True)
        write_json(path, result)
        del copies, weights
    result["layer_us_best"] = total
    print(f"one layer's four GEMVs, best of each: {total:.1f} us", flush=True)
    write_json(path, result)
    return result


if __name__ == "__main__":
    main()
