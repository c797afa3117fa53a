"""Structured-output overhead: W1 with every request under a JSON schema against W1 unconstrained, same
engine, same run, alternating; plus the host time of filling each step's grammar bitmask.

    python bench/structured_bench.py --out bench/results        # H100: dummy Llama-3-8B, 64 x 512 -> 256
    python bench/structured_bench.py --device cpu --quick --out /tmp/s   # smoke: the default model, tiny sizes

Dummy (random) weights emit whatever the mask allows, so the schema must not let a request end early: it
asks for an array of at least 100 small objects (more than 256 tokens), and every request sets ignore_eos,
so both runs produce exactly `output_len` tokens each. Strings are bounded with patterns, which xgrammar
compiles to one automaton (a `maxLength` would be unrolled into a rule per character and make masks
slow). The dummy model borrows the default model's tokenizer (49,152 tokens): grammars work on those ids,
the model's logits are 128,256 wide and the ids above the tokenizer's are masked out. Outputs are checked
to be a prefix the grammar accepts, token by token.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import add_engine_bench_args, device_slug, engine_bench_model, print_table, run_metadata, write_json  # noqa: E402

SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                   "kind": {"enum": ["alpha", "beta", "gamma"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "kind", "n"]}}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_bench_args(parser)
    parser.add_argument("--quick", action="store_true", help="4 x 32 -> 16, one repeat (the smoke test)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each mode")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args(argv)
    args.model = engine_bench_model(args)
    args.num_requests, args.input_len, args.output_len = (4, 32, 16) if args.quick else (64, 512, 256)
    args.repeats = 1 if args.quick else args.repeats
    return args


def build_llm(args):
    from minivllm import LLM
    from minivllm.models.loader import resolve_model
    options = dict(seed=0, device=args.device, max_num_seqs=args.num_requests, max_num_batched_tokens=8192,
                   max_model_len=args.input_len + args.output_len + 16)
    if args.model != "default":
        options.update(model=args.model, load_format="dummy", tokenizer=resolve_model(None).tokenizer_dir)
    if args.device == "cuda":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        options["kv_cache_memory"] = 256 << 20
    return LLM(**options)


def run(llm, args, constrained: bool, seed: int) -> dict:
    from minivllm import SamplingParams
    from minivllm.sampling_params import StructuredOutputsParams
    tokenizer_size = len(llm.get_tokenizer())
    rng = random.Random(seed)  # fresh prompts: no prefix-cache hits between runs
    prompts = [{"prompt_token_ids": [rng.randrange(tokenizer_size) for _ in range(args.input_len)]}
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA) if constrained else None)
    manager = llm.llm_engine.structured_output
    manager.mask_time_s, manager.num_masks = 0.0, 0
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    counts = [len(o.outputs[0].token_ids) for o in outputs]
    if any(c != args.output_len for c in counts):
        raise RuntimeError(f"requests produced {sorted(set(counts))} tokens, not {args.output_len}")
    if constrained:
        check_grammar_prefix(params.structured_outputs.compiled, outputs)
    return {"elapsed_s": elapsed, "output_tokens_per_s": sum(counts) / elapsed,
            "mask_ms_per_step": 1e3 * manager.mask_time_s / max(manager.num_masks, 1),
            "num_masked_steps": manager.num_masks}


def check_grammar_prefix(compiled, outputs) -> None:
    import xgrammar as xgr
    for output in outputs:
        matcher = xgr.GrammarMatcher(compiled)
        for token_id in output.outputs[0].token_ids:
            if not matcher.accept_token(token_id):
                raise RuntimeError(f"token {token_id} of {output.request_id} breaks the grammar")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    meta = run_metadata(device)
    print(f"structured outputs benchmark | {meta['device']} | {meta['commit']} | {args.model} | "
          f"{args.num_requests} x {args.input_len} -> {args.output_len}")
    llm = build_llm(args)
    run(llm, argparse.Namespace(**{**vars(args), "num_requests": min(8, args.num_requests),
                                   "output_len": min(16, args.output_len)}), True, seed=1)  # warm-up, both modes
    run(llm, argparse.Namespace(**{**vars(args), "num_requests": min(8, args.num_requests),
                                   "output_len": min(16, args.output_len)}), False, seed=2)
    rows = []
    for repeat in range(args.repeats):
        for constrained in (False, True):
            result = run(llm, args, constrained, seed=100 + 2 * repeat + constrained)
            rows.append({"repeat": repeat, "mode": "json_schema" if constrained else "none", **result})
            print(rows[-1])
    none = statistics.median(r["output_tokens_per_s"] for r in rows if r["mode"] == "none")
    constrained = statistics.median(r["output_tokens_per_s"] for r in rows if r["mode"] == "json_schema")
    masks = [r["mask_ms_per_step"] for r in rows if r["mode"] == "json_schema"]
    result = {**meta, "model": args.model, "workload": f"{args.num_requests} x {args.input_len} -> {args.output_len}",
              "schema": SCHEMA, "none_output_tokens_per_s": none, "json_output_tokens_per_s": constrained,
              "throughput_cost": 1 - constrained / none, "mask_ms_per_step": statistics.median(masks),
              "mask_us_per_row": 1e3 * statistics.median(masks) / args.num_requests,
              "outputs_verified": True, "runs": rows}
    write_json(args.out / f"structured_{device_slug(meta['device'])}.json", result)
    print_table([{"metric": k, "value": result[k]} for k in (
        "none_output_tokens_per_s", "json_output_tokens_per_s", "throughput_cost", "mask_ms_per_step",
        "mask_us_per_row")], "structured outputs: JSON schema on every request vs none")
    return result


if __name__ == "__main__":
    main()
