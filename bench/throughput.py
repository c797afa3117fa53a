"""Offline throughput of minivllm against the hardware's floor and a transformers peer, in one command.

    python bench/throughput.py --out bench/results                     # roofline + peer + W1 + single stream
    python bench/throughput.py --out DIR --skip-w1 --sweeps            # batch and length sweeps (CSV + PNG)
    python bench/throughput.py --out DIR --skip-w1 --ablation          # each optimisation on and off
    python bench/throughput.py --device cpu --quick --out DIR          # everything tiny, on the CPU (smoke test)

W1: dummy-weight Llama-3-8B in bf16, 64 requests x 512 random prompt ids x 256 output tokens, greedy, ignore_eos.
The floor: prefill FLOPs over the measured matmul rate, plus for every decode step the weight and KV bytes it
must read over the measured copy bandwidth (each phase bounded below by the larger of its two times). A step
reads every weight except an untied embedding table, of which it gathers only a few rows.
Owns nothing in the engine: it uses the public `LLM` API and reads the runner's KV-cache sizes.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.common import (ModelShape, device_slug, load_hf_config, measure_copy_bandwidth,  # noqa: E402
                          measure_matmul_rate, percentiles, print_table, run_metadata, tuner_us, write_csv,
                          write_json)

FUSIONS_ENV = "MINIVLLM_DISABLE_FUSIONS"


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: int
    output_len: int

    def __str__(self) -> str:
        return f"{self.num_requests} x {self.prompt_len} -> {self.output_len}"


@dataclass(frozen=True)
class Sizes:
    w1: Workload
    single_stream: Workload
    sweep_batches: tuple[int, ...]       # at sweep_batch_lengths
    sweep_batch_lengths: tuple[int, int]
    sweep_lengths: tuple[tuple[int, int], ...]  # (prompt, output) at sweep_length_batch requests
    sweep_length_batch: int
    ablation: Workload
    ablation_single: Workload


FULL = Sizes(w1=Workload(64, 512, 256), single_stream=Workload(1, 512, 128),
             sweep_batches=(1, 4, 16, 64, 128, 256), sweep_batch_lengths=(512, 256),
             sweep_lengths=((128, 128), (512, 512), (1024, 1024), (2048, 256), (4096, 128)), sweep_length_batch=64,
             ablation=Workload(64, 512, 128), ablation_single=Workload(1, 512, 64))
QUICK = Sizes(w1=Workload(4, 32, 8), single_stream=Workload(1, 32, 4),
              sweep_batches=(1, 2), sweep_batch_lengths=(32, 4),
              sweep_lengths=((16, 4), (64, 2)), sweep_length_batch=2,
              ablation=Workload(2, 32, 4), ablation_single=Workload(1, 32, 4))


# ---- engine runs --------------------------------------------------------------------------------------------
def random_prompts(workload: Workload, vocab_size: int, seed: int) -> list[list[int]]:
    """Fresh random ids per call: distinct prompts never hit the prefix cache."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(workload.prompt_len)] for _ in range(workload.num_requests)]


def build_llm(args, max_num_seqs: int, max_model_len: int, **overrides):
    from minivllm import LLM
    options = dict(model=args.model, load_format="dummy", dtype=args.dtype, device=args.device, seed=0,
                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max(args.max_num_batched_tokens, max_num_seqs),
                   max_model_len=max_model_len, skip_tokenizer_init=True)
    if args.device == "cuda":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        options["kv_cache_memory"] = args.cpu_kv_cache_memory
    options.update(overrides)
    started = time.perf_counter()
    llm = LLM(**options)
    print(f"  engine built in {time.perf_counter() - started:.1f} s: "
          + ", ".join(f"{k}={v}" for k, v in options.items() if k not in ("model", "load_format")))
    return llm


def free_device_memory(device: torch.device) -> None:
    """Call after dropping the last reference to a model: the next one gets the memory back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        print(f"  freed: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB still allocated")


def timed_generate(llm, prompts: list[list[int]], output_len: int, lora_request=None) -> dict:
    """Generate, time it, and check every request produced exactly `output_len` tokens. `lora_request`: as
    `LLM.generate` takes it (one adapter, or one per prompt)."""
    from minivllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    extra = {} if lora_request is None else {"lora_request": lora_request}
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **extra)
    elapsed = time.perf_counter() - started   # the engine reads sampled ids on the host each step: no sync needed
    counts = [len(o.outputs[0].token_ids) for o in outputs]
    wrong = [c for c in counts if c != output_len]
    if len(outputs) != len(prompts) or wrong:
        raise RuntimeError(f"{len(wrong)} of {len(prompts)} requests did not produce {output_len} tokens "
                           f"(counts seen: {sorted(set(counts))})")
    num_prompt = sum(len(p) for p in prompts)
    num_output = sum(counts)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    result = {"elapsed_s": elapsed, "num_prompt_tokens": num_prompt, "num_output_tokens": num_output,
              "output_tokens_per_s": num_output / elapsed, "total_tokens_per_s": (num_prompt + num_output) / elapsed,
              "outputs_verified": True, "num_cached_tokens": sum(o.num_cached_tokens for o in outputs),
              "median_ttft_s": percentiles(ttft, (50,))["p50"]}
    if output_len > 1:
        # Time per output token after the first, per request: the decode speed each user sees.
        tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (output_len - 1) for o in outputs]
        result["median_tpot_ms"] = 1e3 * percentiles(tpot, (50,))["p50"]
    return result


def warm_up(llm, workload: Workload, vocab_size: int, num_requests: int = 8, output_len: int = 16,
            lora_requests: list | None = None) -> None:
    """A short run at the same prompt length: compiles kernels and fills allocator pools (and, given
    `lora_requests`, loads each adapter into its slot)."""
    small = Workload(max(min(num_requests, workload.num_requests), len(lora_requests or [])), workload.prompt_len,
                     min(output_len, workload.output_len))
    timed_generate(llm, random_prompts(small, vocab_size, seed=12345), small.output_len,
                   None if lora_requests is None else [lora_requests[i % len(lora_requests)]
                                                       for i in range(small.num_requests)])


# ---- the floor ----------------------------------------------------------------------------------------------
def floor_seconds(shape: ModelShape, workload: Workload, bandwidth: float, matmul_rate: float) -> tuple[float, float]:
    """(prefill, decode) seconds no implementation can beat. The prefill samples the first output token;
    each of the other output_len - 1 steps reads all weights and every sequence's KV cache so far."""
    n, p = workload.num_requests, workload.prompt_len
    prefill_flops = shape.matmul_flops(n * p, n) + n * shape.attention_flops(p, p)
    prefill = max(prefill_flops / matmul_rate, (shape.step_weight_bytes + n * p * shape.kv_bytes_per_token) / bandwidth)
    decode = 0.0
    for step in range(1, workload.output_len):
        context = p + step
        step_bytes = shape.step_weight_bytes + n * context * shape.kv_bytes_per_token
        step_flops = shape.matmul_flops(n, n) + n * shape.attention_flops(1, context)
        decode += max(step_bytes / bandwidth, step_flops / matmul_rate)
    return prefill, decode


def floor_output_tokens_per_s(shape, workload, bandwidth, matmul_rate) -> float:
    return workload.num_requests * workload.output_len / sum(floor_seconds(shape, workload, bandwidth, matmul_rate))


# ---- sections -----------------------------------------------------------------------------------------------
def measure_roofline(device: torch.device, dtype: torch.dtype) -> dict:
    bandwidth = measure_copy_bandwidth(device)
    matmul_rate = measure_matmul_rate(device, dtype)
    print(f"roofline: copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), "
          f"{dtype} matmul {matmul_rate / 1e12:.4g} TFLOP/s")
    return {"copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": matmul_rate}


def run_peer(hf_config, prompts: list[list[int]], output_len: int, device: torch.device, dtype: torch.dtype) -> dict:
    """transformers `generate` on one static batch (all prompts the same length: no padding), sdpa attention."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    config = AutoConfig.for_model(**hf_config.to_dict())   # transformers' own config object from the same values
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    input_ids = torch.tensor(prompts, device=device)
    options = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        tiny = input_ids[:2, :16]
        model.generate(tiny, attention_mask=torch.ones_like(tiny), max_new_tokens=4, min_new_tokens=4, **options)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, **options)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
    expected = (len(prompts), len(prompts[0]) + output_len)
    if tuple(out.shape) != expected:
        raise RuntimeError(f"peer produced {tuple(out.shape)} tokens, expected {expected}")
    del model, out
    num_output = len(prompts) * output_len
    return {"elapsed_s": elapsed, "output_tokens_per_s": num_output / elapsed,
            "total_tokens_per_s": (num_output + sum(map(len, prompts))) / elapsed}


def kv_cache_info(llm, args) -> dict:
    """How much of the memory left after weights became KV blocks, and how many tokens fit."""
    runner = llm.llm_engine.runner
    if runner.device.type == "cuda":
        total = torch.cuda.get_device_properties(runner.device).total_memory
        allowed = args.gpu_memory_utilization * total - runner.weight_bytes
    else:
        allowed = runner.kv_budget_bytes
    return {"num_blocks": runner.num_blocks, "block_size": runner.block_size,
            "tokens": runner.num_blocks * runner.block_size, "kv_bytes": runner.kv_cache_bytes,
            "budget_bytes": runner.kv_budget_bytes, "weight_bytes": runner.weight_bytes,
            "allowed_after_weights_bytes": int(allowed), "fraction_of_budget": runner.kv_cache_bytes / allowed}


def run_w1(args, sizes: Sizes, shape: ModelShape, hf_config, roofline: dict, device: torch.device) -> dict:
    w1, single = sizes.w1, sizes.single_stream
    bandwidth, matmul_rate = roofline["copy_bandwidth_bytes_per_s"], roofline["matmul_flops_per_s"]
    prompts = random_prompts(w1, shape.vocab_size, seed=0)
    result: dict = {"workload": str(w1), "model": args.model, "dtype": args.dtype}

    if not args.skip_peer:  # first: the engine later takes gpu_memory_utilization of the card
        print(f"\npeer: transformers generate, static batch {w1}")
        peer = run_peer(hf_config, prompts, w1.output_len, device, torch_dtype(args))
        free_device_memory(device)
        print(f"  {peer['output_tokens_per_s']:.1f} output tok/s in {peer['elapsed_s']:.2f} s")
        result.update(peer_output_tokens_per_s=peer["output_tokens_per_s"], peer=peer)

    print(f"\nminivllm W1: {w1}")
    llm = build_llm(args, max_num_seqs=w1.num_requests,
                    max_model_len=max(w1.prompt_len + w1.output_len, single.prompt_len + single.output_len))
    result["weight_bytes_loaded"] = llm.llm_engine.runner.weight_bytes
    if result["weight_bytes_loaded"] != shape.weight_bytes:
        print(f"  note: the engine holds {result['weight_bytes_loaded']} weight bytes, the config gives "
              f"{shape.weight_bytes}; the floor uses the config's count")
    warm_up(llm, w1, shape.vocab_size)
    run = timed_generate(llm, prompts, w1.output_len)
    print(f"  {run['output_tokens_per_s']:.1f} output tok/s, {run['total_tokens_per_s']:.1f} total tok/s "
          f"in {run['elapsed_s']:.2f} s (every request: {w1.output_len} tokens)")
    floor_prefill, floor_decode = floor_seconds(shape, w1, bandwidth, matmul_rate)
    floor_tps = w1.num_requests * w1.output_len / (floor_prefill + floor_decode)
    result.update(output_tokens_per_s=run["output_tokens_per_s"], total_tokens_per_s=run["total_tokens_per_s"],
                  floor_output_tokens_per_s=floor_tps, achieved_over_floor=run["output_tokens_per_s"] / floor_tps,
                  floor_prefill_s=floor_prefill, floor_decode_s=floor_decode, outputs_verified=run["outputs_verified"],
                  run=run)
    if "peer_output_tokens_per_s" in result:
        result["ratio_over_peer"] = run["output_tokens_per_s"] / result["peer_output_tokens_per_s"]

    print(f"\nsingle stream: {single}")
    run1 = timed_generate(llm, random_prompts(single, shape.vocab_size, seed=1), single.output_len)
    _, decode_floor = floor_seconds(shape, single, bandwidth, matmul_rate)
    floor_ms = 1e3 * decode_floor / (single.output_len - 1)
    result["single_stream"] = {"workload": str(single), "ms_per_token": run1["median_tpot_ms"],
                               "tokens_per_s": 1e3 / run1["median_tpot_ms"], "floor_ms_per_token": floor_ms,
                               "floor_tokens_per_s": 1e3 / floor_ms, "ttft_s": run1["median_ttft_s"],
                               "outputs_verified": run1["outputs_verified"]}
    print(f"  {run1['median_tpot_ms']:.2f} ms/token ({1e3 / run1['median_tpot_ms']:.1f} tok/s); "
          f"floor {floor_ms:.2f} ms/token")
    result["kv_cache"] = kv_cache_info(llm, args)
    result["tuner_us"] = tuner_us("dense_gemv")
    del llm
    free_device_memory(device)
    return result


def run_sweeps(args, sizes: Sizes, shape: ModelShape, roofline: dict, device: torch.device) -> list[dict]:
    prompt_len, output_len = sizes.sweep_batch_lengths
    points = [("batch", Workload(b, prompt_len, output_len)) for b in sizes.sweep_batches]
    points += [("length", Workload(sizes.sweep_length_batch, p, o)) for p, o in sizes.sweep_lengths]
    max_len = max(w.prompt_len + w.output_len for _, w in points)
    print(f"\nsweeps: {len(points)} points")
    llm = build_llm(args, max_num_seqs=max(w.num_requests for _, w in points), max_model_len=max_len)
    rows = []
    for i, (kind, workload) in enumerate(points):
        warm_up(llm, workload, shape.vocab_size, num_requests=4, output_len=4)
        run = timed_generate(llm, random_prompts(workload, shape.vocab_size, seed=100 + i), workload.output_len)
        floor_tps = floor_output_tokens_per_s(shape, workload, roofline["copy_bandwidth_bytes_per_s"],
                                              roofline["matmul_flops_per_s"])
        rows.append({"sweep": kind, "batch": workload.num_requests, "prompt_len": workload.prompt_len,
                     "output_len": workload.output_len, "elapsed_s": run["elapsed_s"],
                     "output_tokens_per_s": run["output_tokens_per_s"], "total_tokens_per_s": run["total_tokens_per_s"],
                     "floor_output_tokens_per_s": floor_tps, "achieved_over_floor": run["output_tokens_per_s"] / floor_tps,
                     "median_ttft_s": run["median_ttft_s"], "median_tpot_ms": run.get("median_tpot_ms")})
        print(f"  {kind:6s} {workload}: {run['output_tokens_per_s']:.1f} output tok/s "
              f"({rows[-1]['achieved_over_floor']:.2f} of floor) in {run['elapsed_s']:.2f} s")
    del llm
    free_device_memory(device)
    return rows


def plot_sweeps(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    batch = [r for r in rows if r["sweep"] == "batch"]
    left.plot([r["batch"] for r in batch], [r["output_tokens_per_s"] for r in batch], "o-", label="minivllm")
    left.plot([r["batch"] for r in batch], [r["floor_output_tokens_per_s"] for r in batch], "k--", label="floor")
    left.set(xscale="log", yscale="log", xlabel="batch (requests)", ylabel="output tok/s",
             title=f"prompt {batch[0]['prompt_len']}, output {batch[0]['output_len']}")
    left.legend()
    length = [r for r in rows if r["sweep"] == "length"]
    labels = [f"{r['prompt_len']}/{r['output_len']}" for r in length]
    x = range(len(length))
    right.bar([i - 0.2 for i in x], [r["output_tokens_per_s"] for r in length], width=0.4, label="minivllm")
    right.bar([i + 0.2 for i in x], [r["floor_output_tokens_per_s"] for r in length], width=0.4, label="floor",
              color="lightgray")
    right.set_xticks(list(x), labels)
    right.set(xlabel="prompt/output tokens", ylabel="output tok/s", title=f"batch {length[0]['batch']}")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def fusions_switch_exists() -> bool:
    """Whether the engine reads MINIVLLM_DISABLE_FUSIONS (else a fusions-off row would measure nothing)."""
    package = Path(__file__).resolve().parent.parent / "minivllm"
    return any(FUSIONS_ENV in f.read_text() for f in package.rglob("*.py"))


def run_ablation(args, sizes: Sizes, shape: ModelShape, device: torch.device) -> list[dict]:
    """Each optimisation added in turn, from the plain-PyTorch eager engine to the default one."""
    eager = dict(attention_backend="torch", enforce_eager=True, async_scheduling=False)
    triton = {**eager, "attention_backend": "triton"}
    decode_graphs = {**triton, "enforce_eager": False, "cuda_graph_max_tokens": 0}
    overlapped = {**decode_graphs, "async_scheduling": True}
    configs = [  # (name, engine options, fusions)
        ("torch attention, eager", eager, False),
        ("+ triton attention", triton, False),
        ("+ CUDA graphs for decode steps", decode_graphs, False),
        ("+ fusions", decode_graphs, True),
        ("+ async scheduling", overlapped, True),
        ("+ CUDA graphs for prompt steps (default)", {"attention_backend": "triton"}, True),
    ]
    if device.type != "cuda":   # no Triton, CUDA graphs or overlap on the CPU
        configs = [("torch attention, eager", eager, False), ("+ fusions", eager, True)]
    if not fusions_switch_exists():
        print(f"note: the engine does not read {FUSIONS_ENV}: fusions stay as built in every row")
        configs = [(name, options, True) for name, options, fusions in configs if fusions]
    work, single = sizes.ablation, sizes.ablation_single
    prompts = random_prompts(work, shape.vocab_size, seed=200)
    single_prompt = random_prompts(single, shape.vocab_size, seed=201)
    rows = []
    for name, options, fusions in configs:
        print(f"\nablation: {name}")
        if fusions:
            os.environ.pop(FUSIONS_ENV, None)
        else:
            os.environ[FUSIONS_ENV] = "1"   # read when the model is built
        try:
            llm = build_llm(args, max_num_seqs=work.num_requests,
                            max_model_len=max(work.prompt_len + work.output_len, single.prompt_len + single.output_len),
                            **options)
        finally:
            os.environ.pop(FUSIONS_ENV, None)
        warm_up(llm, work, shape.vocab_size)
        run = timed_generate(llm, prompts, work.output_len)
        run1 = timed_generate(llm, single_prompt, single.output_len)
        engine = llm.llm_engine
        rows.append({"config": name, "attention_backend": engine.config.attention_backend,
                     "cuda_graphs": not engine.config.enforce_eager,
                     "cuda_graph_max_tokens": engine.config.cuda_graph_max_tokens,
                     "fusions": fusions, "async_scheduling": engine.async_scheduling,
                     "output_tokens_per_s": run["output_tokens_per_s"], "total_tokens_per_s": run["total_tokens_per_s"],
                     "elapsed_s": run["elapsed_s"], "single_stream_ms_per_token": run1["median_tpot_ms"]})
        print(f"  {run['output_tokens_per_s']:.1f} output tok/s; single stream {run1['median_tpot_ms']:.2f} ms/token")
        del llm, engine
        free_device_memory(device)
    return rows


# ---- main ---------------------------------------------------------------------------------------------------
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for JSON/CSV/PNG results")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="dummy config name (default: llama-3-8b, tiny-llama on CPU)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--quick", action="store_true", help="small workloads (the smoke test)")
    parser.add_argument("--skip-peer", action="store_true", help="no transformers peer")
    parser.add_argument("--skip-w1", action="store_true", help="no W1 / single-stream section")
    parser.add_argument("--sweeps", action="store_true", help="batch and length sweeps -> CSV + PNG")
    parser.add_argument("--ablation", action="store_true", help="optimisations on/off -> ablation JSON")
    add_build_llm_args(parser)
    return resolve_engine_args(parser, parser.parse_args(argv))


def add_build_llm_args(parser) -> None:
    """The engine sizes `build_llm` reads."""
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--cpu-kv-cache-memory", type=int, default=64 * 2**20, help="KV bytes on the CPU")


def resolve_engine_args(parser, args):
    """Defaults by device: Llama-3-8B in bf16 on CUDA, tiny-llama in fp32 on the CPU."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available")
    args.model = args.model or ("llama-3-8b" if args.device == "cuda" else "tiny-llama")
    args.dtype = getattr(args, "dtype", None) or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def torch_dtype(args) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]


def main(argv: list[str] | None = None) -> dict:
    """Runs the chosen sections; returns {'w1': ..., 'sweeps': ..., 'ablation': ...} for those run."""
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch_dtype(args)
    sizes = QUICK if args.quick else FULL
    meta = run_metadata(device)
    slug = device_slug(meta["device"])
    hf_config = load_hf_config(args.model)
    shape = ModelShape.from_hf_config(hf_config, dtype)
    print(f"minivllm throughput benchmark | device {meta['device']} | commit {meta['commit']} | {meta['date']}")
    print(f"model {args.model} (dummy weights, {shape.num_params / 1e9:.3f} B params, {args.dtype}), "
          f"sections: {'' if args.skip_w1 else 'w1 '}{'sweeps ' if args.sweeps else ''}"
          f"{'ablation' if args.ablation else ''}, {'quick' if args.quick else 'full'} sizes")
    roofline = measure_roofline(device, dtype)
    results: dict = {}
    summary = []

    if not args.skip_w1:
        w1 = {**meta, **run_w1(args, sizes, shape, hf_config, roofline, device), **roofline,
              "weight_bytes": shape.weight_bytes, "step_weight_bytes": shape.step_weight_bytes,
              "kv_bytes_per_token": shape.kv_bytes_per_token}
        write_json(args.out / f"throughput_w1_{slug}.json", w1)
        results["w1"] = w1
        summary += [{"metric": f"W1 output tok/s ({sizes.w1})", "value": w1["output_tokens_per_s"]},
                    {"metric": "W1 total tok/s", "value": w1["total_tokens_per_s"]},
                    {"metric": "W1 floor output tok/s", "value": w1["floor_output_tokens_per_s"]},
                    {"metric": "W1 achieved / floor", "value": w1["achieved_over_floor"]}]
        if "ratio_over_peer" in w1:
            summary += [{"metric": "peer (transformers) output tok/s", "value": w1["peer_output_tokens_per_s"]},
                        {"metric": "minivllm / peer", "value": w1["ratio_over_peer"]}]
        single = w1["single_stream"]
        summary += [{"metric": "single stream ms/token", "value": single["ms_per_token"]},
                    {"metric": "single stream tok/s", "value": single["tokens_per_s"]},
                    {"metric": "single stream floor tok/s", "value": single["floor_tokens_per_s"]},
                    {"metric": "KV tokens", "value": w1["kv_cache"]["tokens"]},
                    {"metric": "KV bytes / allowed after weights", "value": w1["kv_cache"]["fraction_of_budget"]}]

    if args.sweeps:
        rows = run_sweeps(args, sizes, shape, roofline, device)
        write_csv(args.out / f"throughput_sweep_{slug}.csv", [{**r, "device": meta["device"], "commit": meta["commit"],
                                                                "date": meta["date"]} for r in rows])
        plot_sweeps(rows, f"minivllm {args.model} {args.dtype} on {meta['device']} ({meta['commit']}, "
                    f"{meta['date'][:10]})", args.out / f"throughput_sweep_{slug}.png")
        results["sweeps"] = rows
        print_table(rows, "sweeps")

    if args.ablation:
        rows = run_ablation(args, sizes, shape, device)
        write_json(args.out / f"ablation_{slug}.json", {**meta, "model": args.model, "dtype": args.dtype,
                                                        "workload": str(sizes.ablation),
                                                        "single_stream_workload": str(sizes.ablation_single),
                                                        "rows": rows})
        results["ablation"] = rows
        print_table(rows, "ablation (each row adds one optimisation)")

    print_table(summary, f"summary: {args.model} on {meta['device']}, commit {meta['commit']}, "
                         f"{time.perf_counter() - started:.0f} s in all")
    return results


if __name__ == "__main__":
    main()
