"""The int4 GEMV tiles at one row chosen by timing the whole decode step, not each GEMV alone.

    python bench/kernels/step_tile_search.py --out bench/results

kernels/tuning.py times each GEMV alone, repeated in a graph, where each call's weights stream in under the
previous call's tail. In a decode step the GEMVs sit behind other kernels (o_proj behind the attention reduce),
so the tile that wins alone need not win there. This script builds the batch-1 int4 engine (dummy Llama-3-8B,
GPTQ layout) as bench/quant_bench.py does and lets the tuner choose. Then:
- the device's activities between two async decode steps (torch.profiler, CUDA activity only, so the host is
  barely slowed), each with its start and length: what a step spends outside its graph (step_gap_<device>.json);
- for each one-row GEMV key in turn (qkv with its norm and rotation, o, gate_up with its norm and SiLU, down),
  the decode graph recaptured with each candidate tile in place of the tuner's and its replay timed (device
  time of the whole step, events around back-to-back replays); each pass of this coordinate search keeps each
  key's best;
- the tuner's set and the searched set alternating over rounds of batch-1 decode through the engine (median
  time per output token, as quant_bench.py measures it), beside the graph's replay time, so the step's time
  outside the graph shows (step_tile_search_<device>.json).

The tuner starts from its own timings (MINIVLLM_TUNED_CONFIGS=0). With --write-configs DIR, the searched choices
of every one-row key go to DIR/<device name>.json, the file kernels/tuning.py reads from kernels/configs/.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import device_slug, graph_replay_us, run_metadata, write_json  # noqa: E402
from bench.kernels.pdl_bench import recapture_graphs  # noqa: E402
from bench.quant_bench import SINGLE, engine_options  # noqa: E402
from bench.throughput import random_prompts, timed_generate, warm_up  # noqa: E402


def extra_tiles() -> list:
    """Around the first search's winner (32, 16, 3, 8, columns 4, rows 2, one program an SM, half): ring depth, stage size,
    warps, the thread's share, tile width; and gate_up's (64, 8, 2, 4, columns 8, two an SM) with 8 warps or one an
    SM. None of them is among the tuner's candidates."""
    from minivllm.kernels.int4_gemv_tma import TmaGemvConfig as T
    return [T(32, 16, 4, 8, 4, 2, 1, True), T(32, 16, 2, 8, 4, 2, 1, True), T(32, 32, 2, 8, 4, 2, 1, True),
            T(32, 16, 3, 8, 8, 2, 1, True), T(32, 16, 3, 8, 4, 4, 1, True), T(32, 16, 3, 16, 4, 2, 1, True),
            T(32, 16, 3, 4, 4, 2, 1, True), T(16, 16, 3, 8, 4, 2, 1, True), T(64, 16, 2, 8, 4, 2, 1, True),
            T(64, 8, 3, 8, 8, 2, 1, True), T(64, 8, 2, 8, 8, 2, 2, True)]


ONE_ROW_KEYS = {"weight_only_rotary": "qkv_proj", "weight_only_silu_and_mul": "gate_up_proj"}


def layer_of(key) -> str | None:
    """The layer a one-row tuning key belongs to (Llama-3-8B shapes), or None."""
    if key[0] in ONE_ROW_KEYS:
        return ONE_ROW_KEYS[key[0]]
    if key[0] == "weight_only" and key[4] == 1:
        return {(4096, 4096): "o_proj", (4096, 14336): "down_proj"}.get((key[5], key[6]))
    return None


def as_choice(key, tile):
    """What tuning._chosen holds for `key` with the Gluon tile `tile`: the tile, or (tile, split 1)."""
    return (tile, 1) if key[0] == "weight_only" else tile


def replay_us(llm, replays: int) -> float:
    """Device microseconds per replay of the batch-1 decode graph (its inputs as the last step left them)."""
    return graph_replay_us(llm.llm_engine.runner.graph_runner.graphs[1], replays)


def step_gap(llm, vocab: int, out: Path, device: torch.device) -> dict:
    """Per async decode step, the activities from the end of one step's last layer kernel to the next step's
    first: [name, start us from that end, length us]."""
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_step import kernel_timeline
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one = timed_generate(llm, random_prompts(SINGLE, vocab, seed=77), 24)
    timeline = kernel_timeline(prof)
    heads = [i for i, e in enumerate(timeline) if e[0].startswith("nvjet") or "gemm" in e[0].lower()]
    firsts = [i for i, e in enumerate(timeline) if "indexSelect" in e[0] or "embedding" in e[0].lower()]
    gaps = []
    for first in firsts[2:-1]:
        previous_head = max((h for h in heads if h < first), default=None)
        if previous_head is None:
            continue
        end = timeline[previous_head][1] + timeline[previous_head][2]
        gaps.append([[e[0], round(e[1] - end, 2), e[2]] for e in timeline[previous_head + 1:first + 2]])
    result = {**run_metadata(device), "tpot_us": 1e3 * one["median_tpot_ms"], "between_steps": gaps[:6]}
    for e in (gaps[0] if gaps else []):
        print(f"  {e[0]:<60} +{e[1]:8.2f} us  {e[2]:7.2f} us", flush=True)
    write_json(out / f"step_gap_{device_slug(result['device'])}.json", result)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--layers", default="o_proj,qkv_proj,gate_up_proj,down_proj", help="the layers searched, in order")
    parser.add_argument("--extra-tiles", action="store_true",
                        help="also try extra_tiles(), variants of the searched winner that are not the tuner's candidates")
    parser.add_argument("--write-configs", type=Path, default=None,
                        help="a folder for the searched choices, in kernels/configs/'s format")
    args = parser.parse_args(argv)
    os.environ["MINIVLLM_TUNED_CONFIGS"] = "0"   # the search starts from the tuner's own timings
    from minivllm import LLM
    from minivllm.kernels import tuning
    from minivllm.kernels.int4_gemm import tma_gemv_tiles
    from minivllm.kernels.int4_gemv_tma import layout_split

    device = torch.device("cuda")
    # decode graphs only (the prompt runs eagerly): each candidate recaptures them
    llm = LLM(**engine_options(args.model, "int4", device, SINGLE, args.gpu_memory_utilization),
              cuda_graph_max_tokens=0)
    vocab = llm.llm_engine.runner.vocab_size
    warm_up(llm, SINGLE, vocab)
    step_gap(llm, vocab, args.out, device)
    keys: dict[str, list] = {}   # a layer's keys: qkv's norm adds no residual in the first layer
    for key in tuning._chosen:
        if layer_of(key) is not None:
            keys.setdefault(layer_of(key), []).append(key)
    tuned = {layer: [tuning._chosen[k] for k in layer_keys] for layer, layer_keys in keys.items()}
    print("tuner's choices:", {layer: str(choice) for layer, choice in tuned.items()}, flush=True)
    tiles = tma_gemv_tiles(1, 128, 4, torch.bfloat16, device)
    if args.extra_tiles:
        tiles += [t for t in extra_tiles() if t not in tiles and layout_split(t, 128 // 8) is not None]
    result = {**run_metadata(device), "model": args.model, "quantization": "gptq", "workload": str(SINGLE),
              "tuned": {layer: str(c) for layer, c in tuned.items()}, "search": []}
    started = time.perf_counter()
    baseline = replay_us(llm, args.replays)
    result["tuned_replay_us"] = baseline
    print(f"tuner's set: {baseline:.1f} us a step (graph replay)", flush=True)
    for pass_index in range(args.passes):
        for layer in args.layers.split(","):
            layer_keys = keys.get(layer, [])
            if not layer_keys:
                continue
            current = [tuning._chosen[k] for k in layer_keys]
            timings = []
            for tile in tiles:
                if layer == "qkv_proj" and 64 % (tile.block_n // 2):
                    continue   # the rotary epilogue's tiles divide half a head
                for key in layer_keys:
                    tuning._chosen[key] = as_choice(key, tile)
                try:
                    recapture_graphs(llm)
                    us = replay_us(llm, args.replays)
                except Exception as e:   # a tile this shape refuses
                    print(f"  {layer} {tile}: {e}", flush=True)
                    continue
                timings.append((us, str(tile), tile))
                result["search"].append({"pass": pass_index, "layer": layer, "tile": str(tile), "replay_us": us})
                print(f"  pass {pass_index} {layer:<13} {tile}: {us:.1f} us", flush=True)
            best = min(timings, key=lambda t: t[0]) if timings else None
            for key, choice in zip(layer_keys, current):
                tuning._chosen[key] = as_choice(key, best[2]) if best else choice
            print(f"pass {pass_index} {layer}: best {best[1] if best else current} {best[0] if best else 0:.1f} us",
                  flush=True)
    searched = {layer: [tuning._chosen[k] for k in layer_keys] for layer, layer_keys in keys.items()}
    result["searched"] = {layer: str(c) for layer, c in searched.items()}
    result["search_seconds"] = time.perf_counter() - started
    write_json(args.out / f"step_tile_search_{device_slug(result['device'])}.json", result)
    # the two sets alternating: graph replay and batch-1 decode through the engine
    rounds = {"tuned": [], "searched": []}
    seed = 0
    for round_index in range(args.rounds):
        for name, chosen in (("tuned", tuned), ("searched", searched)):
            for layer, layer_keys in keys.items():
                for key, choice in zip(layer_keys, chosen[layer]):
                    tuning._chosen[key] = choice
            recapture_graphs(llm)
            seed += 1
            one = timed_generate(llm, random_prompts(SINGLE, vocab, seed=2000 + seed), SINGLE.output_len)
            replay = replay_us(llm, args.replays)
            rounds[name].append({"tok_per_s": 1e3 / one["median_tpot_ms"], "tpot_us": 1e3 * one["median_tpot_ms"],
                                 "replay_us": replay})
            print(f"round {round_index} {name}: {rounds[name][-1]['tok_per_s']:.1f} tok/s, TPOT "
                  f"{rounds[name][-1]['tpot_us']:.0f} us, replay {replay:.0f} us", flush=True)
    result["rounds"] = rounds
    result["median"] = {name: {k: statistics.median(r[k] for r in rows) for k in ("tok_per_s", "tpot_us", "replay_us")}
                        for name, rows in rounds.items()}
    print("medians:", result["median"], flush=True)
    write_json(args.out / f"step_tile_search_{device_slug(result['device'])}.json", result)
    if args.write_configs is not None:
        stored = {key: layer_choice for layer, layer_keys in keys.items()
                  for key, layer_choice in zip(layer_keys, searched[layer])}
        path = args.write_configs / tuning.config_file(result["device"]).name
        write_json(path, {**run_metadata(device), "source": "bench/kernels/step_tile_search.py", "model": args.model,
                          "quantization": "gptq", "median": result["median"],
                          "choices": {repr(key): repr(choice) for key, choice in stored.items()}})
    return result


if __name__ == "__main__":
    main()
