"""Distillation after rounding (minivllm/quantization/distill.py), swept: the default model is rounded once
(GPTQ, or any `minivllm quantize` options), then each STEPS:LR:SCALE_LR setting distills a copy of it on the
calibration text and writes its folder; bench/perplexity.py then scores every folder, beside the unquantized
baseline and the undistilled rounding, on a validation text (choose there, never on the held-out text).

    python bench/distill_sweep.py --calib calib.txt --valid valid.txt --method gptq --no-sym --desc-act \
        --group-size 32 --setting 400:0.01:0.001 --setting 400:0:0.001 --name distill_int4.json --out /tmp/out
"""
from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minivllm.quantization.quantizer import (check_options, distill_roundings, load_for_quantization,  # noqa: E402
                                             round_linears, write_folder)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib", required=True)
    parser.add_argument("--valid", required=True, help="text the settings are scored on")
    parser.add_argument("--method", default="gptq", choices=["rtn", "gptq", "awq"])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--desc-act", action="store_true")
    parser.add_argument("--w8a8", choices=["fp8", "int8"], default=None)
    parser.add_argument("--sequential", action="store_true")
    parser.add_argument("--target-full-precision", action="store_true")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per distillation window")
    parser.add_argument("--setting", action="append", required=True,
                        help="STEPS:LR:SCALE_LR (weights' lr in grid steps; scales' and norms' lr)")
    parser.add_argument("--max-tokens", type=int, default=30_000, help="validation tokens scored")
    parser.add_argument("--folders", default="/tmp/distill", help="where the folders go")
    parser.add_argument("--name", default="distill_sweep.json")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    options = check_options(args.method, args.bits, args.group_size, args.calib, args.sym, args.desc_act,
                            args.w8a8, None, args.sequential, False, args.target_full_precision, False,
                            seq_len=args.seq_len)
    print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "| options:", options)
    hf_model, tokenizer = load_for_quantization(None)
    text = Path(args.calib).read_text(encoding="utf-8", errors="replace")
    teacher = copy.deepcopy(hf_model)
    start = time.perf_counter()
    roundings, prefixes = round_linears(hf_model, tokenizer, text, options)
    print(f"rounded in {time.perf_counter() - start:.0f} s")
    folders = Path(args.folders)
    command = [sys.executable, str(Path(__file__).with_name("perplexity.py")), "--text", args.valid,
               "--max-tokens", str(args.max_tokens), "--window", "1024", "--stride", "512",
               "--dtype", "bfloat16" if torch.cuda.is_available() else "float32", "--name", args.name,
               "--out", args.out]
    rounded = write_folder(hf_model, tokenizer, roundings, prefixes, options, folders / "rounded")
    subprocess.run(command + ["--variant=baseline=", f"--variant=rounded={rounded}"], check=True)
    for setting in args.setting:   # each row is appended as soon as it exists: a timeout loses only the rest
        steps, lr, scale_lr = setting.split(":")
        model, parts, names = copy.deepcopy((hf_model, roundings, prefixes))
        start = time.perf_counter()
        trained = distill_roundings(model, teacher, parts, tokenizer, text, options, int(steps), float(lr),
                                    float(scale_lr))
        print(f"{setting}: distilled in {time.perf_counter() - start:.0f} s")
        name = f"distill-{steps}-{lr}-{scale_lr}"
        folder = write_folder(model, tokenizer, trained, names, options, folders / name)
        subprocess.run(command + ["--append", f"--variant={name}={folder}"], check=True)

if __name__ == "__main__":
    main()
