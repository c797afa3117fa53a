"""A/B of the W8A8 down projection's input at decode sizes: SiLU-and-mul, quantize_rows, then the GEMM (the
path before RowsWithMaxima), against SiLU-and-mul storing its chunk maxima and the GEMM rounding the row as
it reads it (or, where the tuner finds no such tile faster, the first path again). Each path's tile tuned
as in the engine; outputs checked against each other. Dummy Llama-3-8B down_proj shape.

    python bench/w8a8_input_ab.py --out bench/results [--rows 1,2,4,8] [--rounds 5]

Each path is timed from a CUDA graph (tuning.device_seconds), the two alternating for --rounds rounds;
prints the medians and writes w8a8_input_ab_<device>.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import device_slug, run_metadata, write_json  # noqa: E402
from minivllm.kernels.activation import silu_and_mul  # noqa: E402
from minivllm.kernels.quant_rows import quantize_rows  # noqa: E402
from minivllm.kernels import tuning  # noqa: E402
from minivllm.kernels.tuning import device_seconds  # noqa: E402
from minivllm.kernels.w8a8_gemm import FP8, w8a8_gemm, w8a8_gemm_rows  # noqa: E402

INTERMEDIATE, HIDDEN = 14336, 4096


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    meta = run_metadata(device)
    generator = torch.Generator(device=device).manual_seed(0)
    w_codes, w_scale = quantize_rows(torch.randn(HIDDEN, INTERMEDIATE, device=device, generator=generator) * 0.02, FP8)
    w_scale = w_scale.view(-1)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        gate_up = torch.randn(rows, 2 * INTERMEDIATE, device=device, dtype=torch.bfloat16, generator=generator)

        def quantize_then_gemm():
            return w8a8_gemm(*quantize_rows(silu_and_mul(gate_up), FP8), w_codes, w_scale, torch.bfloat16)

        def gemm_rounds_rows():
            return w8a8_gemm_rows(silu_and_mul(gate_up, FP8), w_codes, w_scale, torch.bfloat16)
        before, after = quantize_then_gemm(), gemm_rounds_rows()   # each tunes its tile on the first call
        torch.testing.assert_close(after.float(), before.float(), rtol=2e-2, atol=2e-2 * before.abs().max().item())
        bucket = 1 << max(0, rows - 1).bit_length()
        choices = {"quantize_then_gemm": tuning.chosen(("w8a8", FP8, bucket, HIDDEN, INTERMEDIATE)),
                   "gemm_rounds_rows": tuning.chosen(("w8a8_rows", FP8, bucket, HIDDEN, INTERMEDIATE))}
        times = {"quantize_then_gemm": [], "gemm_rounds_rows": []}
        for _ in range(args.rounds):
            for name, fn in (("quantize_then_gemm", quantize_then_gemm), ("gemm_rounds_rows", gemm_rounds_rows)):
                times[name].append(1e6 * device_seconds(fn, calls=10, repeats=10))
        row = {"rows": rows, **{f"{k}_us": statistics.median(v) for k, v in times.items()},
               "rounds_us": times, "tiles": {k: str(v) for k, v in choices.items()}}
        row["saved_us"] = row["quantize_then_gemm_us"] - row["gemm_rounds_rows_us"]
        results.append(row)
        print(f"rows {rows}: SiLU + quantize + GEMM {row['quantize_then_gemm_us']:.2f} us, SiLU with maxima + "
              f"GEMM rounding as it reads {row['gemm_rounds_rows_us']:.2f} us (saved {row['saved_us']:.2f} us); "
              f"tiles {row['tiles']}", flush=True)
    result = {**meta, "shape": {"K": INTERMEDIATE, "N": HIDDEN}, "results": results}
    write_json(args.out / f"w8a8_input_ab_{device_slug(meta['device'])}.json", result)
    return result


if __name__ == "__main__":
    main()
