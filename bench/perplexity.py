"""Perplexity of quantized variants of one model on held-out text, through the engine's prompt logprobs.

    python bench/perplexity.py --text heldout.txt --variant fp32= --variant fp8=:fp8 \
        --variant int4-gptq=/tmp/q/gptq --max-tokens 100000 --out bench/results

A variant is NAME=MODEL[:QUANTIZATION] (empty MODEL: the default model). Every variant scores the same
token ids (the first variant's tokenizer), with the same windows. Writes quant_quality.json: per variant
perplexity, scored tokens, seconds, and the change against the first variant (the baseline).
With --append, variants are added to an existing quant_quality.json (its first variant stays the
baseline; the text, token count, window and stride must be the same), each with its own commit and date.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import run_metadata  # noqa: E402


def parse_variant(text: str) -> tuple[str, str | None, str | None]:
    name, _, rest = text.partition("=")
    model, _, quantization = rest.partition(":")
    return name, model or None, quantization or None


def main(argv=None) -> None:
    import torch

    from minivllm.engine.llm import LLM
    from minivllm.engine.perplexity import perplexity

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", required=True, help="held-out text file")
    parser.add_argument("--variant", action="append", required=True, help="NAME=MODEL[:QUANTIZATION]")
    parser.add_argument("--max-tokens", type=int, default=100_000, help="score the first N tokens of the text")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="quant_quality.json")
    parser.add_argument("--append", action="store_true", help="add variants to an existing result file")
    args = parser.parse_args(argv)

    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    results, token_ids = {}, None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # where LLM() runs the model
    command = "python " + shlex.join(["bench/perplexity.py", *(sys.argv[1:] if argv is None else argv)])
    setup = {"text": args.text, "max_tokens": args.max_tokens, "window": args.window, "stride": args.stride,
             "dtype": args.dtype}
    record = {**run_metadata(device), **setup, "command": command}
    if args.append:
        record = json.loads((out / args.name).read_text())
        for key, value in setup.items():
            if record.get(key) != value:
                raise ValueError(f"--append: {key} is {value!r} here but {record.get(key)!r} in {args.name}")
        results = record["variants"]
    for spec in args.variant:
        name, model, quantization = parse_variant(spec)
        llm = LLM(model, quantization=quantization, dtype=args.dtype, kv_cache_memory=1 << 30,
                  enable_prefix_caching=False)
        if token_ids is None:
            token_ids = llm.get_tokenizer().encode(text, add_special_tokens=False)[:args.max_tokens]
        started = time.perf_counter()
        result = perplexity(llm, token_ids, args.window, args.stride)
        result.update(model=model or "default", quantization=quantization,
                      seconds=round(time.perf_counter() - started, 1))
        config = Path(model or "").joinpath("config.json")
        if model and config.is_file():   # an offline-quantized folder: record how (group size, act-order, ...)
            result["quantization_config"] = json.loads(config.read_text()).get("quantization_config")
        if args.append:
            result["run"] = {**run_metadata(device), "command": command}
        baseline = next(iter(results.values()), result)
        result["vs_baseline_percent"] = round(100 * (result["perplexity"] / baseline["perplexity"] - 1), 3)
        results[name] = result
        print(f"{name}: ppl {result['perplexity']:.4f} ({result['vs_baseline_percent']:+.2f}%) over "
              f"{result['num_scored_tokens']} tokens in {result['seconds']} s", flush=True)
        del llm
        record["variants"] = results
        (out / args.name).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
