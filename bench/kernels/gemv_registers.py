"""Registers and shared memory of the one-row int4 Gluon GEMV at the shipped H100 tiles, zeros read or constant.

    python bench/kernels/gemv_registers.py --out bench/results

Runs on the CPU: the kernel is compiled for sm_90 as CI compiles it (the compile function of tests/test_quant_kernels.py), and
Triton's bundled ptxas reports each variant's registers. Registers decide which other kernels' programs fit on an
SM beside this one's (WRITEUP §8). The compile has no divisibility hints, so the engine's own launches may
differ by a few registers. Writes gemv_registers_cpu.json.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"   # a Gluon compile, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import run_metadata, write_json  # noqa: E402
from minivllm.kernels.int4_gemv_tma import TmaGemvConfig  # noqa: E402
from tests.test_quant_kernels import _compile_tma_gemv_for_sm90  # noqa: E402

O_TILE = TmaGemvConfig(32, 16, 3, 8, rows=2, half=True)   # o, qkv and down at the shipped H100 choices
GATE_UP_TILE = TmaGemvConfig(64, 8, 2, 4, columns=8, rows=2, per_sm=2, half=True)
# layer: (tile, epilogue, norm, residual added, KV written)
LAYERS = {"o_proj / down_proj": (O_TILE, 0, False, False, False), "qkv_proj": (O_TILE, 2, True, True, True),
          "gate_up_proj": (GATE_UP_TILE, 1, True, True, False)}


def registers(ptx: str) -> int:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(source), "-o", str(Path(folder) / "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Used (\d+) registers", report).group(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    rows = []
    for layer, (tile, epilogue, norm, add, kv) in LAYERS.items():
        for zeros, zero_dtype in (("read", torch.bfloat16), ("constant", None)):
            ptx, _, shared = _compile_tma_gemv_for_sm90(tile, 128, torch.bfloat16, zero_dtype, epilogue, norm, add, kv)
            rows.append({"layer": layer, "tile": repr(tile), "zeros": zeros, "registers": registers(ptx),
                         "shared_bytes": shared})
            print(rows[-1], flush=True)
    write_json(args.out / "gemv_registers_cpu.json",
               {**run_metadata(torch.device("cpu")), "target": "sm_90a (ptxas -v)", "group_size": 128, "K": 1024,
                "rows": rows})


if __name__ == "__main__":
    main()
