"""The few-token MoE path's two kernels timed apart, over a grid of tiles, at one and eight tokens of Qwen3-30B-A3B
(or Mixtral-8x7B) expert shapes: which (BLOCK_N, BLOCK_K, num_warps) of the gate/up GEMV and of the
down-and-combine GEMV streams the touched experts fastest, against the floor at the copy bandwidth of the same run.

    python bench/kernels/moe_gemv_sweep.py --out bench/results [--model mixtral-8x7b]

Weights are timed cold, as in a decode step: each call reads the next of three copies of the experts (over 100 MB
together). Each tile's output is checked against the plain-PyTorch expert loop first. `kernels/fused_moe.py`'s
GATE_UP_TILES and DOWN_TILES are marked in the table; the engine's tuner pairs those. Writes
moe_gemv_sweep_<device>.json.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (announced_copy_bandwidth, device_slug, load_hf_config, print_table,  # noqa: E402
                          run_metadata, write_json)
from minivllm.kernels import fused_moe  # noqa: E402
from minivllm.kernels.activation import silu_and_mul_reference  # noqa: E402
from minivllm.kernels.pdl import launch_options  # noqa: E402
from minivllm.kernels.tuning import device_seconds  # noqa: E402
from minivllm.layers.fused_moe import select_experts  # noqa: E402

GATE_UP_GRID = list(itertools.product((1, 2, 4, 8, 16), (512, 1024, 2048), (1, 2, 4, 8)))
DOWN_GRID = list(itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024), (2, 4, 8)))
COPIES = 3


def sweep(num_tokens: int, shapes: tuple[int, int, int, int], bandwidth: float, device: torch.device) -> list[dict]:
    num_experts, hidden, inter, top_k = shapes
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    copies = [(torch.randn(num_experts, 2 * inter, hidden, device=device, generator=g).mul_(0.02).to(dtype),
               torch.randn(num_experts, hidden, inter, device=device, generator=g).mul_(0.02).to(dtype))
              for _ in range(COPIES)]
    x = torch.randn(num_tokens, hidden, device=device, generator=g).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, device=device, generator=g), top_k, True)
    flat_ids, flat_weights = ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous().float()
    slots = num_tokens * top_k
    touched = int(ids.unique().numel())
    pdl = launch_options(device)
    activated = torch.empty(slots, inter, dtype=dtype, device=device)
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
    turn = itertools.count()

    def gate_up(tile, w13=None):
        n, k, warps = tile
        w13 = copies[next(turn) % COPIES][0] if w13 is None else w13
        fused_moe._moe_gate_up_gemv_kernel[(slots, triton.cdiv(inter, n))](
            x, w13, w13, flat_ids, activated, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1),
            activated.stride(0), 0, TOP_K=top_k, SCALED=False, BLOCK_N=n, BLOCK_K=k, num_warps=warps, **pdl)

    def down(tile, w2=None):
        n, k, warps = tile
        w2 = copies[next(turn) % COPIES][1] if w2 is None else w2
        fused_moe._moe_down_combine_gemv_kernel[(num_tokens, triton.cdiv(hidden, n))](
            activated, w2, w2, flat_ids, flat_weights, out, hidden, inter, activated.stride(0), w2.stride(0),
            w2.stride(1), out.stride(0), 0, TOP_K=top_k, SCALED=False, BLOCK_TOPK=triton.next_power_of_2(top_k),
            BLOCK_N=n, BLOCK_K=k, num_warps=warps, **pdl)

    w13, w2 = copies[0]
    expected = fused_moe.fused_experts_reference(x, w13, w2, weights, ids)
    slot_w13 = w13[flat_ids].float()   # [slots, 2I, H]: each slot's expert
    slot_x = x.float().repeat_interleave(top_k, dim=0)[:, :, None]
    expected_activated = silu_and_mul_reference((slot_w13 @ slot_x)[..., 0])
    rows = []
    for name, fn, grid, shipped, nbytes in (
            ("gate_up", gate_up, GATE_UP_GRID, fused_moe.GATE_UP_TILES, touched * 2 * inter * hidden * 2),
            ("down", down, DOWN_GRID, fused_moe.DOWN_TILES, touched * hidden * inter * 2)):
        for tile in grid:
            n, k, warps = tile
            if n * k * (top_k if name == "down" else 2) > 65536:   # register tile past what a program holds
                continue
            if name == "down":   # checked with the shipped gate/up tile's output in `activated`
                gate_up(fused_moe.GATE_UP_TILES[0], w13)
                down(tile, w2)
                diff = (out.float() - expected.float()).abs().max().item()
            else:
                gate_up(tile, w13)
                diff = (activated.float() - expected_activated).abs().max().item()
            seconds = device_seconds(lambda: fn(tile), calls=2 * COPIES, repeats=9)
            floor = nbytes / bandwidth
            rows.append({"kernel": name, "tokens": num_tokens, "tile": list(tile), "shipped": tile in shipped,
                         "us": 1e6 * seconds, "floor_us": 1e6 * floor, "of_floor": floor / seconds,
                         "max_abs_diff_vs_looped": diff})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default="1,8")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    config = load_hf_config(args.model)
    shapes = (getattr(config, "num_experts", None) or config.num_local_experts, config.hidden_size,
              getattr(config, "moe_intermediate_size", None) or config.intermediate_size, config.num_experts_per_tok)
    result = run_metadata(device)
    result["command"] = "python bench/kernels/moe_gemv_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    bandwidth = announced_copy_bandwidth(device, result)
    result.update({"model": args.model, "experts_hidden_inter_topk": shapes, "copy_bandwidth_bytes_per_s": bandwidth})
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        rows += sweep(m, shapes, bandwidth, device)
    result["rows"] = rows
    for kernel, m in itertools.product(("gate_up", "down"), sorted({r["tokens"] for r in rows})):
        ranked = sorted((r for r in rows if r["kernel"] == kernel and r["tokens"] == m), key=lambda r: r["us"])
        result[f"best_{kernel}_m{m}"] = ranked[0]
        print_table(ranked[:10] + [r for r in ranked[10:] if r["shipped"]], f"{kernel}, {m} token(s), fastest first")
    write_json(args.out / f"moe_gemv_sweep_{device_slug(result['device'])}.json", result)
    return result


if __name__ == "__main__":
    main()
