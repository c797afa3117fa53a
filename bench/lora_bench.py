"""What multi-LoRA serving costs against the base model, in one process and run (docs/lora.md).

    python bench/lora_bench.py --out bench/results                 # dummy Llama-3-8B, bf16, on the GPU
    python bench/lora_bench.py --device cpu --quick --out DIR      # tiny-llama on the CPU (the smoke test)

The bench writes its own adapters: 8 rank-16 PEFT folders on all seven projections (q/k/v/o/gate/up/down) with
random non-zero A and B. W1 (64 x 512 -> 256, greedy, ignore_eos) runs on the base model alone, then with the
requests spread evenly over the 8 adapters; a single stream (1 x 512 -> 128) runs on the base model, then under
one adapter. The base numbers come from an engine without LoRA, built and dropped before the LoRA engine, so
the ratios include everything LoRA adds (its kernels, slots, and the fused epilogues it turns off).
Writes lora_<gpu>.json with the keys of issue 46's acceptance.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.common import (add_engine_bench_args, device_slug, load_hf_config, print_table,  # noqa: E402
                          run_metadata, write_json)
from bench.throughput import (FULL, QUICK, add_build_llm_args, build_llm, free_device_memory,  # noqa: E402
                              random_prompts, resolve_engine_args, timed_generate, warm_up)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: Path, hf_config, rank: int, targets=PROJECTIONS, seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> str:
    """A PEFT LoRA folder for a Llama-shaped `hf_config`, A and B random and non-zero (alpha = 2 * rank)."""
    from safetensors.torch import save_file
    hidden, intermediate = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
              "down_proj": (hidden, intermediate)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for target in targets:
            out_features, in_features = shapes[target]
            block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            a = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator) * 0.1).to(dtype)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none"}))
    return str(folder)


def measure(llm, sizes, vocab_size: int, w1_loras=None, single_lora=None) -> dict:
    """W1 and single-stream tokens/s of one engine (with the given adapters, None: the base model)."""
    w1, single = sizes.w1, sizes.single_stream
    warm_up(llm, w1, vocab_size, lora_requests=w1_loras)
    prompts = random_prompts(w1, vocab_size, seed=0)
    loras = None if w1_loras is None else [w1_loras[i % len(w1_loras)] for i in range(len(prompts))]
    run = timed_generate(llm, prompts, w1.output_len, loras)
    print(f"  W1 {w1}: {run['output_tokens_per_s']:.1f} output tok/s in {run['elapsed_s']:.2f} s")
    run1 = timed_generate(llm, random_prompts(single, vocab_size, seed=1), single.output_len, single_lora)
    print(f"  single stream {single}: {run1['median_tpot_ms']:.2f} ms/token")
    return {"w1_out_tok_s": run["output_tokens_per_s"], "single_tok_s": 1e3 / run1["median_tpot_ms"],
            "w1": run, "single": run1}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_bench_args(parser)   # --out, --device, --model (here tiny-llama by default on the CPU)
    parser.add_argument("--quick", action="store_true", help="small workloads (the smoke test)")
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    add_build_llm_args(parser)
    return resolve_engine_args(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> dict:
    from minivllm import LoRARequest
    args = parse_args(argv)
    device = torch.device(args.device)
    sizes = QUICK if args.quick else FULL
    meta = run_metadata(device)
    hf_config = load_hf_config(args.model)
    max_model_len = max(sizes.w1.prompt_len + sizes.w1.output_len,
                        sizes.single_stream.prompt_len + sizes.single_stream.output_len)
    print(f"minivllm LoRA benchmark | device {meta['device']} | commit {meta['commit']} | {meta['date']}")
    print(f"model {args.model} (dummy weights, {args.dtype}), {args.num_adapters} adapters of rank {args.rank} "
          f"on {', '.join(PROJECTIONS)}")
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as folder:
        started = time.perf_counter()
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        loras = [LoRARequest(f"adapter{i}", i + 1, write_random_adapter(Path(folder) / f"adapter{i}", hf_config,
                                                                        args.rank, seed=i, dtype=dtype))
                 for i in range(args.num_adapters)]
        print(f"  wrote {len(loras)} adapters in {time.perf_counter() - started:.1f} s")

        print("\nbase model (an engine without LoRA)")
        llm = build_llm(args, max_num_seqs=sizes.w1.num_requests, max_model_len=max_model_len)
        base = measure(llm, sizes, hf_config.vocab_size)
        del llm
        free_device_memory(device)

        print(f"\nwith LoRA: W1 spread over {len(loras)} adapters, the single stream under one")
        llm = build_llm(args, max_num_seqs=sizes.w1.num_requests, max_model_len=max_model_len, enable_lora=True,
                        max_loras=len(loras), max_lora_rank=args.rank)
        lora = measure(llm, sizes, hf_config.vocab_size, w1_loras=loras, single_lora=loras[0])
        del llm
        free_device_memory(device)

    result = {**meta, "model": args.model, "dtype": args.dtype, "num_adapters": len(loras), "rank": args.rank,
              "w1_workload": str(sizes.w1), "single_workload": str(sizes.single_stream),
              "base_w1_out_tok_s": base["w1_out_tok_s"], "lora8_w1_out_tok_s": lora["w1_out_tok_s"],
              "lora8_over_base_w1": lora["w1_out_tok_s"] / base["w1_out_tok_s"],
              "base_single_tok_s": base["single_tok_s"], "lora_single_tok_s": lora["single_tok_s"],
              "lora_single_over_base": lora["single_tok_s"] / base["single_tok_s"],
              "runs": {"base": base, "lora": lora}}
    write_json(args.out / f"lora_{device_slug(meta['device'])}.json", result)
    print_table([{"metric": k, "value": result[k]} for k in (
        "base_w1_out_tok_s", "lora8_w1_out_tok_s", "lora8_over_base_w1", "base_single_tok_s", "lora_single_tok_s",
        "lora_single_over_base")], "LoRA vs base")
    return result


if __name__ == "__main__":
    main()
