"""Programmatic dependent launch on and off (kernels/pdl.py), alternating in one process per format; or
another switch read when the graphs are captured (--variable MINIVLLM_TUNE_COLD --retune: the GEMM tiles
tuned cold or hot, timed again before each capture).

    python bench/kernels/pdl_bench.py --formats bf16,fp8,int4 --settings 1,2,0 --rounds 3 --w1 --out bench/results

Dummy Llama-3-8B per format, built as bench/quant_bench.py builds it (the same W1-sized engine). After the
warm-up, each round recaptures the CUDA graphs with each MINIVLLM_PDL setting in turn (1: the next kernel
launches once a kernel is past its wait, 2: at its start, 0: off) and times batch-1 decode (1 x 512 -> 128,
median time per output token); the tuned tiles are kept, so the launches are the only difference. With
--w1, W1 (64 x 512 -> 256) is timed once per setting in the last round. Every run has its own random
prompts, so none finds an earlier run's in the prefix cache.
Writes pdl_<device>.json: every timing, and per format the median batch-1 tok/s per setting and its ratio
to setting 0.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import device_slug, run_metadata, write_json  # noqa: E402
from bench.quant_bench import SINGLE, W1, engine_options  # noqa: E402
from bench.throughput import free_device_memory, random_prompts, timed_generate, warm_up  # noqa: E402


def recapture(llm, setting: str, variable: str = "MINIVLLM_PDL", retune: bool = False) -> None:
    os.environ[variable] = setting
    if retune:   # the capture's warm-up passes time the GEMM tiles again, under the new setting
        from minivllm.kernels import tuning
        tuning._chosen.clear()
    recapture_graphs(llm)


def recapture_graphs(llm) -> None:
    """The engine's CUDA graphs captured again (settings and tuning choices read at capture take effect)."""
    engine = llm.llm_engine
    runner = engine.runner
    runner.graph_runner = None   # the old graphs and their pool go before the new ones are captured
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_cuda_graphs(engine.config.max_num_seqs, engine.max_model_len)


def format_rows(args, fmt: str) -> dict:
    from minivllm import LLM
    # retuning before each capture times every graph's shapes again: without W1, an engine for batch 1 only
    sized = SINGLE if args.retune and not args.w1 else W1
    llm = LLM(**engine_options(args.model, fmt, torch.device("cuda"), sized, args.gpu_memory_utilization))
    vocab = llm.llm_engine.runner.vocab_size
    warm_up(llm, sized, vocab)
    settings = args.settings.split(",")
    timings = {setting: [] for setting in settings}
    w1 = {}
    seed = 0
    for round_index in range(args.rounds):
        for setting in settings:
            recapture(llm, setting, args.variable, args.retune)
            seed += 1   # new prompts each time: no prefix-cache hits
            one = timed_generate(llm, random_prompts(SINGLE, vocab, seed=1000 + seed), SINGLE.output_len)
            timings[setting].append(1e3 / one["median_tpot_ms"])
            print(f"{fmt:<5} round {round_index} {args.variable} {setting}: batch 1 {timings[setting][-1]:.1f} tok/s", flush=True)
            if args.w1 and round_index == args.rounds - 1:
                w1[setting] = timed_generate(llm, random_prompts(W1, vocab, seed=seed),
                                             W1.output_len)["output_tokens_per_s"]
                print(f"{fmt:<5} W1 {args.variable} {setting}: {w1[setting]:.0f} tok/s", flush=True)
    os.environ.pop(args.variable, None)
    del llm
    free_device_memory(torch.device("cuda"))
    medians = {setting: statistics.median(values) for setting, values in timings.items()}
    row = {"format": fmt, "decode_batch1_tokens_per_s": timings, "median_batch1": medians,
           "workloads": {"decode_batch1": str(SINGLE), "w1": str(W1)}}
    if "0" in medians:
        row["batch1_vs_off"] = {setting: value / medians["0"] for setting, value in medians.items()}
    if w1:
        row["w1_output_tokens_per_s"] = w1
        if "0" in w1:
            row["w1_vs_off"] = {setting: value / w1["0"] for setting, value in w1.items()}
    print(f"{fmt:<5} batch 1 medians: " + ", ".join(f"{args.variable} {k} {v:.1f}" for k, v in medians.items()) + " tok/s",
          flush=True)
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--formats", default="bf16,fp8,int4")
    parser.add_argument("--settings", default="1,0", help="the variable's values, in the order each round runs them")
    parser.add_argument("--variable", default="MINIVLLM_PDL",
                        help="the environment variable alternated (MINIVLLM_TUNE_COLD with --retune: the GEMM "
                             "tiles timed on weights cold, 1, or hot, 0)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--retune", action="store_true",
                        help="forget the tuned GEMM tiles before each capture (for MINIVLLM_TUNE_COLD)")
    parser.add_argument("--w1", action="store_true", help="also W1, once per setting in the last round")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("pdl_bench needs a CUDA GPU")
    device = torch.device("cuda")
    result = {**run_metadata(device), "model": args.model, "rounds": args.rounds, "variable": args.variable,
              "formats": []}
    stem = "pdl" if args.variable == "MINIVLLM_PDL" else args.variable.lower().removeprefix("minivllm_")
    path = args.out / f"{stem}_{device_slug(result['device'])}.json"
    print(f"{result.get('device')} {result.get('commit')} model={args.model}", flush=True)
    for fmt in args.formats.split(","):
        result["formats"].append(format_rows(args, fmt))
        write_json(path, result)
    return result


if __name__ == "__main__":
    main()
