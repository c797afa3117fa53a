"""What one kernel boundary of a decode step costs: a CUDA graph of dependent Triton kernels that do almost nothing.

Each kernel reads what the one before it wrote and writes one value per element back (a few KB in all), so its
time in the chain is the boundary: the previous grid draining and its writes becoming visible, this grid's
launch and its first loads. Timed with programmatic dependent launch on and off (kernels/pdl.py), for grids of
one program to several per SM. A batch-1 decode layer of the engine is a chain like this with weights streamed in
some of its links (docs/models.md counts them per model), so the chain's cost per kernel, times the layer's
kernels, is time no faster GEMV can win back.

    python bench/kernels/launch_chain.py --out bench/results

Writes launch_chain_<device>.json: microseconds per kernel (median of rounds) per grid size and PDL setting.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import device_slug, run_metadata, write_json  # noqa: E402
from minivllm.kernels import tuning  # noqa: E402
from minivllm.kernels.pdl import launch_options, wait_for_previous  # noqa: E402

BLOCK = 128


@triton.jit
def _link_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs) + 1.0)


def chain_us(programs: int, pdl: bool, length: int, rounds: int, replays: int) -> float:
    """Microseconds per kernel of a chain of `length` dependent kernels: `replays` chains captured in one graph,
    the median of `rounds` replays (`tuning.device_seconds`)."""
    a = torch.zeros(programs * BLOCK, device="cuda")
    b = torch.zeros_like(a)
    options = launch_options(a.device) if pdl else {"PDL": 0}

    def run_chain():
        for i in range(length):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            _link_kernel[(programs,)](src, dst, BLOCK=BLOCK, num_warps=4, **options)
    seconds = tuning.device_seconds(run_chain, calls=replays, repeats=rounds)
    # Every kernel run adds one: after T of them in order, one buffer holds T and the other T - 1. device_seconds
    # runs the chain twice before its capture (the compile, the side-stream warm-up), then replays it.
    runs = length * (2 + rounds * replays)
    if not torch.all(a + b == 2 * runs - 1) or not torch.all((a - b).abs() == 1):
        raise AssertionError("the chain's kernels did not run in order")
    return 1e6 * seconds / length


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--length", type=int, default=240, help="kernels in the graph")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=20, help="chains captured in one graph")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("launch_chain needs a CUDA GPU")
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    result = {**run_metadata(device), "kernels_per_graph": args.length, "sms": sms, "rows": []}
    pdl_available = launch_options(device)["PDL"] > 0
    for programs in (1, sms, 4 * sms, 16 * sms):
        for pdl in (True, False) if pdl_available else (False,):
            median = chain_us(programs, pdl, args.length, args.rounds, args.replays)
            result["rows"].append({"programs": programs, "pdl": pdl, "us_per_kernel": median})
            print(f"{programs:>6} programs  pdl={int(pdl)}  {median:.2f} us per kernel", flush=True)
    write_json(args.out / f"launch_chain_{device_slug(result['device'])}.json", result)
    return result


if __name__ == "__main__":
    main()
