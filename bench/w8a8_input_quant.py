"""W8A8 at decode sizes: the activation quantized by quant_rows before the GEMM, against each Triton tile
quantizing its 16-bit input itself (kernels/w8a8_gemm.w8a8_gemm_unquantized), on the Llama-3-8B shapes
whose input no norm quantizes (o_proj, and down_proj below 16 rows). Each timed from a CUDA graph.

    python bench/w8a8_input_quant.py --out bench/results      -> w8a8_input_quant_<gpu>.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import device_slug, run_metadata  # noqa: E402
from minivllm.kernels.quant_rows import FP8, quantize_rows  # noqa: E402
from minivllm.kernels.tuning import device_seconds  # noqa: E402
from minivllm.kernels.w8a8_gemm import candidates, w8a8_gemm, w8a8_triton  # noqa: E402

SHAPES = {"o_proj": (4096, 4096), "down_proj": (4096, 14336), "qkv_proj": (6144, 4096)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows_out = []
    for name, (N, K) in SHAPES.items():
        w_codes, w_scale = quantize_rows(torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02, FP8)
        w_scale = w_scale.view(-1)
        for M in map(int, args.rows.split(",")):
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            separate = device_seconds(lambda: w8a8_gemm(*quantize_rows(x, FP8), w_codes, w_scale, x.dtype))
            fused = []
            for tile in candidates(M, N, K, device):
                if tile is not None:
                    fused.append((device_seconds(lambda: w8a8_triton(x, None, w_codes, w_scale, x.dtype, tile)), tile))
            best_s, best = min(fused, key=lambda t: t[0])
            row = {"layer": name, "M": M, "N": N, "K": K, "separate_us": separate * 1e6, "in_gemm_us": best_s * 1e6,
                   "in_gemm_tile": best._asdict(), "bytes_floor_us": N * K / 2.97e12 * 1e6}
            rows_out.append(row)
            print(f"{name} M={M}: quant_rows + gemm {separate * 1e6:.2f} us, in the gemm {best_s * 1e6:.2f} us "
                  f"({tuple(best)})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {**run_metadata(device), "rows": rows_out}
    (out / f"w8a8_input_quant_{device_slug(record['device'])}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
