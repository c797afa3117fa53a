"""The Gluon int4 GEMV on plain against tiled weights (int4_gemv_tma.tile_columns), on the 8B layer shapes (H100).

    python bench/gemv_layout_ab.py --out bench/results

Plain GPTQ words ([K / 8, N], N fastest) give a tile's K step as `rows` runs of 4 x BLOCK_N bytes, each in
another DRAM page; tiled, the same bytes are one contiguous run. Each tile candidate is checked against the
reference, then timed cold (its calls rotate through weight copies that exceed L2) in two settings:
- chain: the GEMV alone, back to back (as the tuner and bench/gemv_cold_sweep.py time it: one call's start
  hides under the last one's end);
- layer: a decode layer's dependency chain, each GEMV followed by the fused add + RMSNorm kernel that
  consumes its output (qkv, o, gate_up, down: the best tile of each), so each GEMV's start and end are paid
  as in the engine; for MINIVLLM_PDL 1 and 2.
Writes gemv_layout_ab_<device>.json.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import device_slug, run_metadata, write_json  # noqa: E402
from bench.gemv_cold_sweep import GROUP, random_int4  # noqa: E402
from bench.quant_bench import LAYERS_8B  # noqa: E402
from minivllm.kernels import int4_gemm  # noqa: E402
from minivllm.kernels.int4_gemv_tma import TMA_GEMV_TILES, TmaGemvConfig, int4_gemv_tma, layout_split, tile_columns  # noqa: E402,E501
from minivllm.kernels.rmsnorm import fused_add_rms_norm  # noqa: E402
from minivllm.kernels.tuning import cold_copies, device_seconds  # noqa: E402

EXTRA_TILES = (TmaGemvConfig(32, 16, 3, 8, columns=4, rows=2, half=True),
               TmaGemvConfig(32, 16, 2, 4, columns=8, rows=4, per_sm=2, half=True),
               TmaGemvConfig(32, 8, 4, 4, columns=8, rows=2, per_sm=2, half=True),
               TmaGemvConfig(32, 16, 4, 8, columns=4, rows=2, half=True),
               TmaGemvConfig(64, 8, 3, 8, columns=8, rows=2, half=True),
               # deeper rings at two programs an SM (the sweep's 96 KB budget gave these 2 stages)
               TmaGemvConfig(64, 8, 3, 4, columns=8, rows=2, per_sm=2, half=True),
               TmaGemvConfig(32, 16, 3, 4, columns=8, rows=2, per_sm=2, half=True),
               TmaGemvConfig(64, 4, 4, 4, columns=8, rows=2, per_sm=2, half=True),
               TmaGemvConfig(32, 8, 6, 4, columns=8, rows=2, per_sm=2, half=True),
               TmaGemvConfig(64, 4, 6, 4, columns=8, rows=2, per_sm=2, half=True),
               TmaGemvConfig(32, 16, 4, 8, columns=8, rows=2, half=True),
               TmaGemvConfig(64, 8, 6, 8, columns=8, rows=2, half=True))


def tiles() -> list[TmaGemvConfig]:
    return [t for t in dict.fromkeys(TMA_GEMV_TILES + EXTRA_TILES)
            if t.block_n in (32, 64) and layout_split(t, GROUP // 8) is not None]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    result = {**run_metadata(device), "rows": [], "layer": []}
    path = args.out / f"gemv_layout_ab_{device_slug(result['device'])}.json"
    best: dict[tuple[str, bool], tuple[float, TmaGemvConfig]] = {}
    shapes = {}
    for name, K, N in LAYERS_8B:
        weights = random_int4(K, N, device)
        x = torch.randn(1, K, device=device).to(torch.bfloat16)
        reference = int4_gemm.weight_only_gemm_reference(x.float(), *weights, GROUP, 4)
        plain_copies = cold_copies(weights)
        for tiled, config in itertools.product((False, True), tiles()):
            copies = ([tuple(tile_columns(t, config.block_n) for t in c) for c in plain_copies] if tiled
                      else plain_copies)
            try:
                out = int4_gemv_tma(x, *copies[0], GROUP, config, n=N)
                error = ((out.float() - reference).abs().max() / reference.abs().max()).item()
                if error > 2e-2:
                    print(f"  {name} {config} tiled={tiled}: error {error:.3g}", flush=True)
                    continue
                turn = itertools.count()
                seconds = device_seconds(lambda: int4_gemv_tma(x, *copies[next(turn) % len(copies)], GROUP, config,
                                                                n=N), calls=max(5, len(copies)), repeats=10)
            except Exception as e:   # a tile that does not fit (registers, shared memory)
                print(f"  {name} {config} tiled={tiled}: {type(e).__name__}: {e}", flush=True)
                continue
            finally:
                if tiled:
                    del copies
            row = {"layer": name, "K": K, "N": N, "tiled": tiled, "candidate": str(config), "us": 1e6 * seconds}
            result["rows"].append(row)
            print(f"{name:>13} tiled={tiled!s:5} {1e6 * seconds:6.2f} us {config}", flush=True)
            if (name, tiled) not in best or seconds < best[name, tiled][0]:
                best[name, tiled] = (seconds, config)
        shapes[name] = (K, N)
        # the same tile with no arithmetic (words to registers, summed), and a torch reduction over the codes
        nbytes = sum(t.numel() * t.element_size() for t in weights)
        config = best[name, False][1]
        os.environ["MINIVLLM_TMA_STREAM_ONLY"] = "1"
        turn = itertools.count()
        stream = device_seconds(lambda: int4_gemv_tma(x, *plain_copies[next(turn) % len(plain_copies)], GROUP,
                                                      config), calls=max(5, len(plain_copies)), repeats=10)
        os.environ["MINIVLLM_TMA_STREAM_ONLY"] = "0"
        turn = itertools.count()
        amax = device_seconds(lambda: plain_copies[next(turn) % len(plain_copies)][0].amax(),
                              calls=max(5, len(plain_copies)), repeats=10)
        qbytes = weights[0].numel() * 4
        row = {"layer": name, "best_us": 1e6 * best[name, False][0], "best_tb_s": nbytes / best[name, False][0] / 1e12,
               "stream_only_us": 1e6 * stream, "stream_only_tb_s": nbytes / stream / 1e12,
               "torch_amax_codes_us": 1e6 * amax, "torch_amax_codes_tb_s": qbytes / amax / 1e12}
        result.setdefault("stream", []).append(row)
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        del plain_copies, weights
        write_json(path, result)
    for tiled in (False, True):
        total = sum(best[name, tiled][0] for name in shapes)
        print(f"chain, best of each, tiled={tiled}: {1e6 * total:.1f} us", flush=True)
        result[f"chain_best_us_tiled_{tiled}"] = 1e6 * total
    # a layer's chain: GEMV -> fused add + RMSNorm over 4096 (its consumer in the engine) for each GEMV
    residual = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    norm_weight = torch.ones(4096, device=device, dtype=torch.bfloat16)
    for tiled in (False, True):
        layer = []
        for name, (K, N) in shapes.items():
            config = best[name, tiled][1]
            weights = random_int4(K, N, device)
            copies = cold_copies(tuple(tile_columns(t, config.block_n) for t in weights) if tiled else weights)
            layer.append((name, K, N, config, copies))
            del weights
        x = torch.randn(1, 14336, device=device, dtype=torch.bfloat16)
        turn = itertools.count()

        def step():
            i = next(turn)
            for name, K, N, config, copies in layer:
                y = int4_gemv_tma(x[:, :K], *copies[i % len(copies)], GROUP, config, n=N)
                fused_add_rms_norm(y[:, :4096], residual, norm_weight, 1e-5)
        for pdl in ("1", "2"):
            os.environ["MINIVLLM_PDL"] = pdl
            seconds = device_seconds(step, calls=8, repeats=10)
            print(f"layer chain tiled={tiled} PDL={pdl}: {1e6 * seconds:.1f} us "
                  f"({', '.join(f'{n} {c}' for n, _, _, c, _ in layer)})", flush=True)
            result["layer"].append({"tiled": tiled, "pdl": int(pdl), "us": 1e6 * seconds,
                                    "tiles": {n: str(c) for n, _, _, c, _ in layer}})
        os.environ["MINIVLLM_PDL"] = "1"
        del layer
        write_json(path, result)
    return result


if __name__ == "__main__":
    main()
