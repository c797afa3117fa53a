"""The 16-bit GEMV tiles of a small model's decode graphs chosen by timing each graph, not each GEMV alone.

    python bench/kernels/rows_tile_search.py --out bench/results [--write-configs minivllm/kernels/configs]

kernels/tuning.py times each candidate of a projection alone, repeated in a graph on cold weights. In a decode graph
of a small model (SmolLM2-135M: 30 layers of 0.7 to 3.5 MB weights) a GEMV is a few microseconds behind other short
kernels, where what counts is how soon it starts and ends under PDL, not its streaming rate; cuBLAS ends the PDL
overlap. This script builds the engine on the model's shapes (dummy weights) with the tuner timing every key
(MINIVLLM_TUNED_CONFIGS=0), then for each row count of the decode graphs (1 to 64: a plain step at batch 1, verify
steps of one sequence and 1 to 15 drafts or of a few sequences, plain steps at a few sequences) and each of its GEMV
keys in turn (qkv, o, gate_up, down), recaptures that graph with every candidate in place of the tuner's and times
the graph of that row count (events around back-to-back replays, rows attending to a 300-token context). One pass of
this coordinate search keeps each key's best. The tuner's set and the searched one are then timed alternating.
With --write-configs DIR the searched choices join DIR/<device name>.json, the file kernels/tuning.py reads.
With --model another model's shapes (dummy weights; an MoE model's experts key is searched too: the few-token GEMV
pair's tiles or the grouped path, per slot count), written to rows_tile_search_<model>_<device>.json:

    python bench/kernels/rows_tile_search.py --model qwen3-30b-a3b --rows 1 --out bench/results
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import device_slug, graph_replay_us, run_metadata, write_json  # noqa: E402
from bench.kernels.pdl_bench import recapture_graphs  # noqa: E402

CONTEXT = 300


def rows_of(key, top_k: int = 0) -> int | None:
    """The row count of a dense GEMV tuning key (1 for a key without one) or of an MoE experts key (its slots over
    the model's `top_k`), None for other kernels' keys."""
    if key[0] == "moe_experts":
        return key[3] // top_k if top_k and key[3] % top_k == 0 else None
    if key[0] != "dense_gemv":
        return None
    return key[-1][1] if isinstance(key[-1], tuple) and key[-1][:1] == ("rows",) else 1


# Streaming tiles beside the tuner's (--extra-stream): other programs per SM and rows per load. One that wins here
# ships only once it is among GEMV_STREAM_TILES (a stored choice must be a candidate).
EXTRA_STREAM_TILES = ((2, 2, 4, "stream"), (6, 2, 4, "stream"), (4, 4, 4, "stream"), (12, 2, 4, "stream"),
                      (8, 1, 4, "stream"))


def candidates_of(key, top_k: int = 0, extra_stream: bool = False) -> tuple:
    """The candidates the tuner times for `key` (kernels/dense_gemv.py's `linear`, kernels/fused_moe.py's
    `fused_experts`), with EXTRA_STREAM_TILES for one row if `extra_stream`."""
    from minivllm.kernels import fused_moe
    from minivllm.kernels.dense_gemv import STREAM_MAX_K, linear_candidates
    if key[0] == "moe_experts":
        return fused_moe.EXPERTS_CANDIDATES
    rows = rows_of(key, top_k)
    extra = EXTRA_STREAM_TILES * (extra_stream and rows == 1 and key[2][1] <= STREAM_MAX_K)
    return (*linear_candidates(rows, key[2], "norm" in key), *extra)


@torch.inference_mode()
def recapture(llm, rows: int) -> None:
    """The `rows`-row decode graph captured again (the tuning choices read at capture take effect)."""
    runner = llm.llm_engine.runner.graph_runner
    runner.seq_lens[:rows] = 1
    runner.graphs[rows] = runner._capture_one(rows, runner._decode_metadata(rows), decode=True)
    runner.seq_lens.zero_()


@torch.inference_mode()
def graph_us(llm, rows: int, replays: int) -> float:
    """Device microseconds a replay of the `rows`-row decode graph takes, each row attending to CONTEXT tokens of
    its own blocks (no KV written), median of three timings of `replays` back-to-back replays."""
    runner = llm.llm_engine.runner.graph_runner
    blocks = -(-CONTEXT // llm.llm_engine.runner.block_size)
    runner.seq_lens[:rows] = CONTEXT
    runner.block_tables[:rows, :blocks] = torch.arange(rows * blocks, device=runner.block_tables.device,
                                                        dtype=runner.block_tables.dtype).view(rows, blocks)
    runner.slot_mapping[:rows] = -1
    return graph_replay_us(runner.graphs[rows], replays, repeats=3)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--extra-stream", action="store_true", help="also time EXTRA_STREAM_TILES at one row")
    parser.add_argument("--write-configs", type=Path, default=None,
                        help="a folder for the searched choices, in kernels/configs/'s format")
    args = parser.parse_args(argv)
    os.environ["MINIVLLM_TUNED_CONFIGS"] = "0"   # the search starts from the tuner's own timings
    from minivllm import LLM
    from minivllm.kernels import tuning

    row_counts = [int(r) for r in args.rows.split(",")]
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, seed=0, max_num_seqs=max(row_counts),
              max_model_len=CONTEXT + 64, cuda_graph_max_tokens=0)
    device = llm.llm_engine.runner.device
    top_k = getattr(llm.llm_engine.runner.hf_config, "num_experts_per_tok", 0) or 0
    keys = {rows: [k for k in tuning._chosen if rows_of(k, top_k) == rows] for rows in row_counts}
    tuned = {k: tuning._chosen[k] for ks in keys.values() for k in ks}
    result = {**run_metadata(device), "model": args.model, "context": CONTEXT,
              "tuned": {repr(k): repr(c) for k, c in tuned.items()}, "search": []}
    for rows in row_counts:
        for key in keys[rows]:
            timings = []
            for candidate in candidates_of(key, top_k, args.extra_stream):
                tuning._chosen[key] = candidate
                try:
                    recapture(llm, rows)
                    us = graph_us(llm, rows, args.replays)
                except Exception as e:   # a tile this shape refuses
                    print(f"  {rows} rows {key[2]} {candidate}: {e}", flush=True)
                    continue
                timings.append((us, candidate))
                result["search"].append({"rows": rows, "key": repr(key), "candidate": repr(candidate), "graph_us": us})
                print(f"  {rows} rows {key[:3]} {candidate}: {us:.1f} us", flush=True)
            tuning._chosen[key] = min(timings, key=lambda t: t[0])[1] if timings else tuned[key]
            print(f"{rows} rows {key[:3]}: tuner {tuned[key]}, searched {tuning._chosen[key]}", flush=True)
    searched = {k: tuning._chosen[k] for k in tuned}
    result["searched"] = {repr(k): repr(c) for k, c in searched.items()}
    rounds = {"tuned": [], "searched": []}
    for _ in range(args.rounds):
        for name, chosen in (("tuned", tuned), ("searched", searched)):
            tuning._chosen.update(chosen)
            recapture_graphs(llm)
            rounds[name].append({rows: graph_us(llm, rows, args.replays) for rows in row_counts})
            print(f"{name}: " + ", ".join(f"{r} rows {us:.1f} us" for r, us in rounds[name][-1].items()), flush=True)
    result["graph_us"] = {name: {rows: statistics.median(r[rows] for r in runs) for rows in row_counts}
                          for name, runs in rounds.items()}
    result["rounds"] = rounds
    print("medians:", result["graph_us"], flush=True)
    model = "" if args.model == "smollm2-135m" else f"{args.model}_"   # one file per model searched
    write_json(args.out / f"rows_tile_search_{model}{device_slug(result['device'])}.json", result)
    if args.write_configs is not None:
        path = tuning.config_file(result["device"]).name
        target = args.write_configs / path
        stored = json.loads(target.read_text()) if target.is_file() else {**run_metadata(device), "choices": {}}
        stored["choices"].update({repr(k): repr(c) for k, c in searched.items()})
        searches = stored.get("rows_search", [])   # one entry per search whose choices the file holds
        stored["rows_search"] = [s for s in searches if (s.get("model"), s.get("rows")) != (args.model, row_counts)] + [
            {"rows": row_counts, **{key: result[key] for key in ("commit", "date", "command", "model", "graph_us")}}]
        write_json(target, stored)
    return result


if __name__ == "__main__":
    main()
