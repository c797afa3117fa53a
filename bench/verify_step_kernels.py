"""Where a verify step's extra device time goes: the decode CUDA graphs of 1, 2, 4 and 8 rows replayed on a
model's shapes (dummy weights) with each graph's CUDA kernels listed (torch.profiler), and every linear
layer's GEMM timed alone at M = 1..16 rows (`F.linear`, the path bf16 weights take, from a CUDA graph of
many calls). On SmolLM2-135M's shapes a verify step of 3-8 rows cost 0.26 ms more than a decode step
(spec_decode_steps_h100.json); the suspicion was cuBLAS leaving its GEMV kernels past 2 rows. Measured
(verify_step_kernels_h100.json, 8e13116): the graphs of 1-8 rows all take 0.91-0.95 ms, so the extra is
outside the model graph (host work and the eager sampling and verification ops). A Triton GEMM for 3-16
rows, tuned per shape against the library, was tried and dropped: on dummy Llama-3-8B a verify step of
k = 1..7 cost 1.00-1.02x a decode step with it at 8e13116 but 1.04-1.09x at ee1180b, against 1.05-1.12x
without it at 3978b08 (history/dense_gemm_ee1180b): within the runs' spread.

Usage: python bench/verify_step_kernels.py --out DIR [--model smollm2-135m]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import device_slug, run_metadata, write_json  # noqa: E402

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)


def linear_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """(N, K) of each distinct linear layer kind: qkv, o, gate_up, down, and the LM head."""
    shapes = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and "norm" not in name and "embed" not in name:
            shapes.setdefault(name.split(".")[-1], tuple(weight.shape))
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(head, "weight", None) is not None:
        shapes["lm_head"] = tuple(head.weight.shape)
    return shapes


def gemm_table(shapes: dict[str, tuple[int, int]]) -> list[dict]:
    """Each layer shape at M rows through the library (F.linear), timed from a CUDA graph of 50 calls."""
    from minivllm.kernels.tuning import device_seconds
    rows = []
    for name, (N, K) in shapes.items():
        weight = torch.randn(N, K, dtype=torch.bfloat16, device="cuda")
        for M in ROWS:
            x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
            rows.append({"layer": name, "N": N, "K": K, "M": M,
                         "library_us": 1e6 * device_seconds(lambda: F.linear(x, weight), calls=50, repeats=20)})
    return rows


def graph_kernels(runner, rows: int, replays: int = 20) -> dict:
    """The decode graph of `rows` rows replayed under the profiler: device time per replay and its kernels."""
    from torch.profiler import ProfilerActivity, profile
    graphs = runner.graph_runner
    graphs.seq_lens[:rows] = 64
    graph = graphs.graphs[rows]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(({"kernel": e.key[:90], "calls_per_replay": e.count / replays,
                       "us_per_replay": e.self_device_time_total / replays}
                      for e in prof.key_averages() if e.self_device_time_total > 0),
                     key=lambda k: -k["us_per_replay"])
    return {"rows": rows, "ms_per_replay": start.elapsed_time(end) / replays,
            "num_kernels": sum(k["calls_per_replay"] for k in kernels), "kernels": kernels[:25]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args(argv)
    from minivllm import LLM
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, seed=0, max_num_seqs=8,
              max_model_len=1024)
    runner = llm.llm_engine.runner
    result = {**run_metadata(torch.device("cuda")), "model": args.model,
              "graphs": [graph_kernels(runner, rows) for rows in (1, 2, 4, 8)],
              "gemm": gemm_table(linear_shapes(runner.model))}
    for g in result["graphs"]:
        print(f"rows {g['rows']}: {g['ms_per_replay']:.3f} ms per replay, {g['num_kernels']:.0f} kernels")
        for k in g["kernels"][:8]:
            print(f"    {k['us_per_replay']:8.1f} us  x{k['calls_per_replay']:5.0f}  {k['kernel']}")
    for row in result["gemm"]:
        print(f"  {row['layer']:>10} {row['N']:>6}x{row['K']:<6} M={row['M']:<3} {row['library_us']:7.2f} us")
    write_json(args.out / f"verify_step_kernels_{device_slug(result['device'])}.json", result)
    return result


if __name__ == "__main__":
    main()
