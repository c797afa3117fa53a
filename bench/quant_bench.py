"""Quantized inference speed against bf16 in the same run, on dummy weights created in each format.

    python bench/quant_bench.py --out bench/results                  # 8B engine runs + GEMM table
    python bench/quant_bench.py --model llama-3-70b --formats int4,fp8 --skip-gemm --out bench/results

Engine rows (per format: bf16, fp8 W8A8, int8 W8A8, int4 = GPTQ layout, group 128, symmetric (GPTQ's default
`sym: true`: every zero point 8, which the one-row GEMV does not read), int4-asym = the same with asymmetric zero
points (read in every group), int4-lmhead = int4 with the LM head quantized too (GPTQ's `lm_head: true`), and
fp8kv = bf16 weights with kv_cache_dtype="fp8"):
batch-1 decode tok/s (1 x 512 -> 128, median time per output token) and W1 (64 x 512 -> 256 output tok/s),
each with its ratio to bf16, and the KV capacity (blocks and tokens at the same gpu_memory_utilization) with
its ratio to bf16's. GEMM rows: y = x W^T for M in {1, 16, 64, 256, 4096}
x the 8B layer shapes, as the linear layers run it (activation quantization included for W8A8), with
achieved weight+activation bytes/s against the measured copy bandwidth and FLOP/s against the measured bf16
matmul rate; each timed hot (one layer's weights, L2-resident below 50 MB) and cold (rotating through copies
of the layer that exceed L2, as a decode step reads them).
The GEMM table runs first (minutes at most), then the engine rows.
Writes quant_<device>.json (or quant_70b_<device>.json); each result is written as soon as it exists,
and a format that fails records its error instead of stopping the run.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (device_slug, measure_copy_bandwidth, measure_matmul_rate, run_metadata,  # noqa: E402
                          time_median, write_json)
from bench.throughput import Workload, free_device_memory, random_prompts, timed_generate, warm_up  # noqa: E402
from minivllm.kernels.tuning import cold_copy_count, device_seconds  # noqa: E402

QUANTIZATION = {"bf16": None, "fp8": "fp8", "int8": "int8", "int4": "gptq"}
# formats named by a checkpoint's quantization_config (dummy weights of a config.json holding it)
STORED_CONFIG = {"int4-lmhead": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                 "sym": True, "lm_head": True},
                 "int4-asym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                               "sym": False}}
KV_CACHE_DTYPE = {"fp8kv": "fp8"}   # engine-only formats: bf16 weights, another KV cache dtype
SINGLE, W1 = Workload(1, 512, 128), Workload(64, 512, 256)
QUICK_SINGLE, QUICK_W1 = Workload(1, 16, 4), Workload(2, 16, 4)
# (name, input features K, output features N) of Llama-3-8B's linear layers (qkv and gate_up packed)
LAYERS_8B = (("qkv_proj", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up_proj", 4096, 28672),
             ("down_proj", 14336, 4096))
GEMM_M = (1, 16, 64, 256, 4096)


def engine_options(model: str | None, fmt: str, device: torch.device, w1: Workload,
                   gpu_memory_utilization: float) -> dict:
    """`LLM` arguments for one format's engine on dummy weights, sized for W1."""
    if fmt in STORED_CONFIG:
        model = dummy_config_with(model, STORED_CONFIG[fmt])
    options = dict(model=model, load_format="dummy", quantization=QUANTIZATION.get(fmt),
                   kv_cache_dtype=KV_CACHE_DTYPE.get(fmt, "auto"), dtype="bfloat16"
                   if device.type == "cuda" else "float32", device=device.type, max_num_seqs=w1.num_requests,
                   max_model_len=w1.prompt_len + w1.output_len, skip_tokenizer_init=True, seed=0)
    if device.type == "cuda":
        options["gpu_memory_utilization"] = gpu_memory_utilization
    else:
        options["kv_cache_memory"] = 64 << 20
    return options


def dummy_config_with(model: str, quantization_config: dict) -> str:
    """A config.json (in a temporary folder) of the shipped dummy config `model` with that quantization_config."""
    from minivllm.models.loader import CONFIGS_DIR
    config = json.loads((CONFIGS_DIR / f"{model}.json").read_text())
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return str(path)


def engine_row(args, fmt: str, device: torch.device) -> dict:
    from minivllm import LLM
    single, w1 = (QUICK_SINGLE, QUICK_W1) if args.quick else (SINGLE, W1)
    options = engine_options(args.model, fmt, device, w1, args.gpu_memory_utilization)
    llm = LLM(**options)
    runner = llm.llm_engine.runner
    vocab = runner.vocab_size
    row = {"format": fmt, "quantization": QUANTIZATION.get(fmt, STORED_CONFIG.get(fmt, {}).get("quant_method")),
           **({"quantization_config": STORED_CONFIG[fmt]} if fmt in STORED_CONFIG else {}),
           "weight_bytes": runner.weight_bytes,
           "kv_cache_dtype": options["kv_cache_dtype"], "num_gpu_blocks": runner.num_blocks,
           "kv_cache_tokens": runner.num_kv_tokens}
    # all of W1's rows (a short run): a GEMM variant first needed at W1's batch sizes (a quantized LM head's,
    # outside the small decode graphs) would otherwise compile inside the timed run
    warm_up(llm, w1, vocab, num_requests=w1.num_requests)
    one = timed_generate(llm, random_prompts(single, vocab, seed=1), single.output_len)
    row["decode_batch1_tokens_per_s"] = 1e3 / one["median_tpot_ms"]
    row["w1_output_tokens_per_s"] = timed_generate(llm, random_prompts(w1, vocab, seed=0),
                                                   w1.output_len)["output_tokens_per_s"]
    row["workloads"] = {"decode_batch1": str(single), "w1": str(w1)}
    del llm, runner
    free_device_memory(device)
    return row


def gemm_rows(device: torch.device, dtype: torch.dtype, quick: bool) -> list[dict]:
    """Each format's linear method on random weights, timed through `apply` as the model calls it."""
    from minivllm.layers.linear import ReplicatedLinear
    from minivllm.quantization import get_config_class, process_weights_after_loading

    rows = []
    layers = (("tiny", 256, 384),) if quick else LAYERS_8B
    for name, K, N in layers:
        for fmt, quantization in QUANTIZATION.items():
            with torch.device(device):
                method = get_config_class(quantization).for_dummy().get_quant_method(None) if quantization else None
                layer = _random_layer(ReplicatedLinear, K, N, method, dtype, device)
                process_weights_after_loading(layer)
            weight_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
            # copies of the layer to rotate through, together over L2's size: a decode step reads each
            # layer's weights from HBM (every other layer's pass through L2 in between)
            extra = cold_copy_count(weight_bytes) - 1 if device.type == "cuda" else 0
            copies = [layer] + [copy.deepcopy(layer) for _ in range(extra)]
            for M in GEMM_M if not quick else (1, 16):
                x = torch.randn(M, K, device=device, dtype=dtype)
                eager = time_median(lambda: layer(x), device, warmup=3, repeats=10 if quick else 30)
                # From a CUDA graph: the device's time, as the engine's graphs run it (timed eagerly, a call
                # of a few small kernels measures the host launching them).
                seconds = device_seconds(lambda: layer(x), calls=10, repeats=20) if device.type == "cuda" else eager
                turn = itertools.count()
                cold = device_seconds(lambda: copies[next(turn) % len(copies)](x), calls=max(10, len(copies)),
                                      repeats=20) if device.type == "cuda" else eager
                moved = weight_bytes + M * (K + N) * x.element_size()
                rows.append({"layer": name, "K": K, "N": N, "M": M, "format": fmt, "us": 1e6 * seconds,
                             "cold_us": 1e6 * cold, "eager_us": 1e6 * eager, "bytes_per_s": moved / seconds,
                             "cold_bytes_per_s": moved / cold, "flops_per_s": 2 * M * K * N / seconds})
            del layer, copies
    return rows


def int4_sweep(device: torch.device, dtype: torch.dtype, quick: bool) -> list[dict]:
    """Tile shapes of the int4 GEMM (group 128) at decode-sized M on the 8B layer shapes, and the
    dequantize + cuBLAS path, each timed from a CUDA graph: picks int4_gemm's defaults."""
    from itertools import product

    from minivllm.kernels.int4_gemm import GemmConfig, dequantize_triton, weight_only_gemm
    from minivllm.kernels.split_k import choose_split_k
    rows = []
    layers = (("tiny", 256, 384),) if quick else LAYERS_8B
    ms = (1, 16) if quick else (1, 8, 16, 64, 128, 256)
    for name, K, N in layers:
        generator = torch.Generator(device=device).manual_seed(0)
        qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), device=device, dtype=torch.int32, generator=generator)
        scales = torch.full((K // 128, N), 0.001, device=device, dtype=dtype)
        zeros = torch.full((K // 128, N), 8.0, device=device, dtype=dtype)
        weight_bytes = qweight.numel() * 4 + 2 * scales.numel() * scales.element_size()
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=dtype)
            candidates = [("dequant+cublas", None, None)]
            block_ms = (1,) if M == 1 else (16,) if M <= 16 else (16, 64)
            for bm, bn, bk, warps, stages in product(block_ms, (32, 64, 128), (64, 128, 256), (4, 8), (2, 4)):
                if bm > 16 and bk == 256 and bn == 128:
                    continue
                config = GemmConfig(bm, bn, bk, warps, stages)
                sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
                auto = choose_split_k(M, N, K, bm, bn, bk, sms)
                for split in sorted({auto, 2 * auto}):
                    candidates.append((f"{config}/split{split}", config, split))
            best = None
            for label, config, split in candidates:
                if config is None:
                    fn = (lambda: x @ dequantize_triton(qweight, scales, zeros, 128, 4, K, dtype))
                else:
                    fn = (lambda: weight_only_gemm(x, qweight, scales, zeros, 128, 4, split_k=split, config=config))
                try:
                    seconds = device_seconds(fn, calls=5, repeats=20)
                except Exception as e:   # a tile that does not fit (shared memory): skip it
                    print(f"  {name} M={M} {label}: {type(e).__name__}", flush=True)
                    continue
                row = {"layer": name, "K": K, "N": N, "M": M, "candidate": label, "us": 1e6 * seconds,
                       "bytes_per_s": (weight_bytes + M * (K + N) * 2) / seconds}
                rows.append(row)
                if best is None or row["us"] < best["us"]:
                    best = row
            dq = next(r for r in rows if r["layer"] == name and r["M"] == M and r["candidate"] == "dequant+cublas")
            print(f"int4 sweep {name:<12} M={M:>4}: best {best['candidate']} {best['us']:.1f} us "
                  f"({best['bytes_per_s'] / 1e12:.2f} TB/s); dequant+cublas {dq['us']:.1f} us", flush=True)
    return rows


def _random_layer(cls, K, N, quant_method, dtype, device):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = cls(K, N, quant_method=quant_method)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(0)
    for param in layer.parameters():
        if not param.is_floating_point():
            param.random_(generator=generator)
        elif param.dim() == 1:
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, device=device, generator=generator).mul_(0.02).to(param.dtype))
    return layer


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--model", default=None, help="dummy config (default: llama-3-8b on CUDA, tiny-llama on CPU)")
    parser.add_argument("--formats", default="bf16,fp8,int8,int4,fp8kv")
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--quick", action="store_true", help="tiny workloads (CPU smoke test)")
    parser.add_argument("--sweep-int4", action="store_true", help="only the int4 GEMM tile sweep (CUDA)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.model = args.model or ("llama-3-8b" if device.type == "cuda" else "tiny-llama")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = run_metadata(device)
    tag = "quant_70b" if "70b" in args.model else "quant"
    path = args.out / f"{tag}_{device_slug(meta['device'])}.json"
    result = {**meta, "model": args.model, "engine": [], "gemm": []}
    if device.type == "cuda":
        result["ceilings"] = {"copy_bandwidth_bytes_per_s": measure_copy_bandwidth(device),
                              "bf16_matmul_flops_per_s": measure_matmul_rate(device, torch.bfloat16)}
    print(f"{meta['device']} {meta['commit']} model={args.model}")
    if args.sweep_int4:
        result["int4_sweep"] = int4_sweep(device, dtype, args.quick)
        write_json(args.out / f"int4_sweep_{device_slug(meta['device'])}.json", result)
        return result
    if not args.skip_gemm:
        try:
            result["gemm"] = gemm_rows(device, dtype, args.quick)
        except Exception as e:
            traceback.print_exc()
            result["gemm_error"] = f"{type(e).__name__}: {e}"
        ceilings = result.get("ceilings")
        for row in result["gemm"]:
            if ceilings:
                row["bandwidth_fraction"] = row["bytes_per_s"] / ceilings["copy_bandwidth_bytes_per_s"]
                row["cold_bandwidth_fraction"] = row["cold_bytes_per_s"] / ceilings["copy_bandwidth_bytes_per_s"]
                row["bf16_flops_fraction"] = row["flops_per_s"] / ceilings["bf16_matmul_flops_per_s"]
            print(f"{row['layer']:<12} M={row['M']:>5} {row['format']:>5}: {row['us']:9.1f} us "
                  f"{row['bytes_per_s'] / 1e12:6.2f} TB/s {row['flops_per_s'] / 1e12:7.1f} TFLOP/s | cold "
                  f"{row['cold_us']:9.1f} us {row['cold_bytes_per_s'] / 1e12:6.2f} TB/s")
        write_json(path, result)
    for fmt in ([] if args.skip_engine else args.formats.split(",")):
        try:
            row = engine_row(args, fmt, device)
        except Exception as e:   # record and go on: the run happens once, unattended
            traceback.print_exc()
            row = {"format": fmt, "error": f"{type(e).__name__}: {e}"}
            free_device_memory(device)
        base = next((r for r in result["engine"] if r["format"] == "bf16" and "error" not in r), None)
        if base and "error" not in row:
            row["decode_vs_bf16"] = row["decode_batch1_tokens_per_s"] / base["decode_batch1_tokens_per_s"]
            row["w1_vs_bf16"] = row["w1_output_tokens_per_s"] / base["w1_output_tokens_per_s"]
            row["kv_cache_tokens_vs_bf16"] = row["kv_cache_tokens"] / base["kv_cache_tokens"]
        print(row, flush=True)
        result["engine"].append(row)
        write_json(path, result)
    return result


if __name__ == "__main__":
    main()
