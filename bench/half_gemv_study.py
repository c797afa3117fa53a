"""Two CPU-side looks at the packed-half int4 GEMV (kernels/int4_gemv_half.py), no GPU needed.

    python bench/half_gemv_study.py --out bench/results

- precision: fp16 sums over one K step (64 rows, two lanes of 32 as the kernel pairs fields j and j + 4, each
  FMA rounded to fp16; a product of two fp16 values is exact in fp64), then fp64, against the exact result:
  centred as the kernel (x (t - c), t = 4 + q / 256 from the LOP3, c = 4 + z / 256) and uncentred (x t summed,
  c times the step's x sum subtracted after), beside bf16's own rounding of y. 4,096 x 256,
  x ~ N(0, 1) in bf16 with 8 channels x 50, codes uniform, z = 8, group 128.
- instructions: the sm_90 SASS of the fp32 and the packed-half GEMV's K loop, compiled here (Triton's bundled
  ptxas, the runtime's 16-byte divisibility hints), counted over the loop's body.
Writes half_gemv_study_cpu.json.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import run_metadata, write_json  # noqa: E402


def precision(K=4096, N=256, group=128, step=64) -> dict:
    torch.manual_seed(0)
    x = torch.randn(K, dtype=torch.float64)
    x[torch.randint(0, K, (8,))] *= 50
    x = x.to(torch.bfloat16).double()
    q = torch.randint(0, 16, (K, N)).double()
    z = torch.full((K // group, N), 8.0, dtype=torch.float64)
    s = (torch.rand(K // group, N, dtype=torch.float64) * 0.02 + 0.001).to(torch.bfloat16).double()
    exact = (x[:, None] * (q - z.repeat_interleave(group, 0)) * s.repeat_interleave(group, 0)).sum(0)

    def f16(t):
        return t.to(torch.float16).double()

    def run(centred: bool) -> torch.Tensor:
        total = torch.zeros(N, dtype=torch.float64)
        for k0 in range(0, K, step):
            g = k0 // group
            centre = 4 + z[g] / 256
            lanes = torch.zeros(2, N, dtype=torch.float64)
            for k in (k0 + 8 * w + j for w in range(step // 8) for j in range(4)):
                for lane, kk in enumerate((k, k + 4)):   # fields j and j + 4 of a word share an f16x2
                    t = 4 + q[kk] / 256   # the LOP3's value
                    lanes[lane] = f16(f16(x[kk]) * (t - centre if centred else t) + lanes[lane])
            acc = lanes.sum(0)
            if not centred:
                acc = acc - centre * x[k0:k0 + step].sum()
            total += 256 * s[g] * acc
        return total

    def of_max(y):
        return ((y - exact).abs().max() / exact.abs().max()).item()
    return {"shape": [K, N], "group": group, "step": step, "centred": of_max(run(True)),
            "uncentred": of_max(run(False)), "bf16_rounding_of_y": of_max(exact.to(torch.bfloat16).double())}


def loop_instructions(sass: str) -> dict:
    """The longest backward branch's body: its instruction count and the most frequent opcodes."""
    lines = [line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", line)]
    addrs = [int(re.match(r"\s*/\*([0-9a-f]{4})\*/", line).group(1), 16) for line in lines]
    best = (0, -1)
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if m and int(m.group(1), 16) < addrs[i] and int(m.group(1), 16) in addrs:
            j = addrs.index(int(m.group(1), 16))
            if i - j > best[1] - best[0]:
                best = (j, i)
    ops = collections.Counter()
    for line in lines[best[0]:best[1] + 1]:
        words = re.sub(r"^\s*/\*[0-9a-f]{4}\*/\s*", "", line).split(";")[0].split()
        ops[words[1] if words[0].startswith("@") else words[0]] += 1
    return {"instructions": best[1] - best[0] + 1, "top_opcodes": dict(ops.most_common(8))}


def compile_sm90(fn, constexprs: dict, num_warps: int, num_stages: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {name: "constexpr" if name in constexprs else
           ("*i32" if name in ("qweight_ptr", "tickets_ptr") else "*fp32" if name == "out_ptr" else "*bf16")
           if name.endswith("_ptr") else "i32" for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name not in constexprs}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def instructions() -> list[dict]:
    from minivllm.kernels.int4_gemm import _int4_gemv_kernel
    from minivllm.kernels.int4_gemv_half import int4_gemv_half_kernel
    common = dict(ASM=True, FUSED_SUM=True, EVEN=True, PDL=1)
    rows = []
    for name, fn, n, k, warps, stages, extra in (
            ("fp32", _int4_gemv_kernel, 256, 64, 2, 4, dict(X_WORDS=True)),
            ("half", int4_gemv_half_kernel, 512, 64, 2, 3, dict(IS_BF16=True, FRACTIONAL_ZEROS=False)),
            ("half", int4_gemv_half_kernel, 1024, 64, 2, 3, dict(IS_BF16=True, FRACTIONAL_ZEROS=False))):
        constexprs = dict(BLOCK_N=n, BLOCK_K=k, STAGES=stages, PREFETCH_WORDS=2 * k // 8, **common, **extra)
        loop = loop_instructions(compile_sm90(fn, constexprs, warps, stages))
        weights = n * k // (32 * warps)   # a thread's weights per K step
        rows.append({"kernel": name, "tile": [n, k, warps, stages], "weights_per_thread_step": weights, **loop,
                     "per_weight": loop["instructions"] / weights})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    result = {**run_metadata(torch.device("cpu")), "precision": precision()}
    print(result["precision"], flush=True)
    result["instructions_sm90"] = instructions()
    write_json(args.out / "half_gemv_study_cpu.json", result)
    return result


if __name__ == "__main__":
    main()
