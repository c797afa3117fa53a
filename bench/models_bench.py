"""The new model families on the device: W1 and single stream for dummy Qwen3-30B-A3B (MoE) and GPT-2 XL,
each against its roofline floor, and the fused MoE kernel against a looped-experts baseline and its floor.

    python bench/models_bench.py --out bench/results                  # -> models_<device>.json
    python bench/models_bench.py --device cpu --quick --models A,B --out DIR   # smoke test (config paths)

W1 is bench/throughput.py's workload (64 x 512 -> 256, greedy, ignore_eos) and single stream 1 x 512 -> 128,
run through the same functions. The floor is throughput.py's (each phase bounded below by the larger of FLOPs
over the measured matmul rate and bytes over the measured copy bandwidth), except that for an MoE model a
step reads only the experts it touches: with B tokens each routed to top_k of E experts, uniformly at
random, E * (1 - (1 - top_k / E) ** B) distinct experts per MoE layer are expected. The byte and FLOP
counts come from the model itself, built on the meta device (no memory), not from hand arithmetic.

Kernel microbenchmark: Qwen3-30B-A3B's expert shapes (E 128, top 8, hidden 2048, 768 per expert), bf16,
M = 1, 8, 16, 64, 512, 4096 tokens with softmax top-k routing of random logits. The floor reads each expert that
the routing actually touched once, plus the activations in and out; the baseline loops over the touched
experts with one gate_up and one down matmul each (transformers' implementation). It runs right after the
roofline, before the models, and its largest row is timed again after them (`..._tflops_after_models`).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.common import (device_slug, load_hf_config, print_table, run_metadata, time_median,  # noqa: E402
                          tuner_us, write_json)
from bench.throughput import (Workload, build_llm, free_device_memory, kv_cache_info,  # noqa: E402
                              measure_roofline, random_prompts, timed_generate, torch_dtype, warm_up)

W1 = Workload(64, 512, 256)
SINGLE = Workload(1, 512, 128)
BATCH8 = Workload(8, 512, 128)
QUICK_W1 = Workload(4, 32, 8)
QUICK_SINGLE = Workload(1, 32, 4)
QUICK_BATCH8 = Workload(2, 32, 4)
# models whose ratios to the floor also go to the top level, under these names
HEADLINE_NAMES = {"qwen3-30b-a3b": "qwen3_moe", "mixtral-8x7b": "mixtral"}
KERNEL_TOKENS = (1, 8, 16, 64, 512, 4096)
QUICK_KERNEL_TOKENS = (1, 7)


# ---- what a step must read and compute ---------------------------------------------------------------------
@dataclass
class StepCost:
    """Bytes and FLOPs of one forward step, counted from the model's own parameters."""
    dense_bytes: int              # weights every step reads: all but lookup tables and experts
    dense_matmul_params: int      # matrix weights each token multiplies (not the LM head, not experts)
    lm_head_params: int
    expert_params: int            # one expert of one MoE layer (gate, up and down)
    num_moe_layers: int
    num_experts: int
    top_k: int
    bytes_per_param: int
    kv_bytes_per_token: int
    attention_flops_per_key: int  # per query token and key it attends to (QK^T and PV, all layers)

    @classmethod
    def of_model(cls, hf_config, dtype: torch.dtype) -> "StepCost":
        from minivllm.layers.attention import Attention
        from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
        from minivllm.layers.fused_moe import FusedMoE
        from minivllm.models.registry import get_model_class
        with torch.device("meta"):
            model = get_model_class(hf_config)(hf_config)
        bytes_per_param = torch.tensor([], dtype=dtype).element_size()
        dense = dense_matmul = lm_head = expert = moe_layers = 0
        num_experts = top_k = 0
        kv_per_token = attention_per_key = 0
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if isinstance(module, ParallelLMHead):
                lm_head = module.weight.numel()
                dense += lm_head + (module.bias.numel() if module.bias is not None else 0)
            elif isinstance(module, VocabParallelEmbedding):
                continue   # a lookup: a step reads only its rows
            elif isinstance(module, FusedMoE):
                expert = (module.w13_weight[0].numel() + module.w2_weight[0].numel())
                moe_layers += 1
                num_experts, top_k = module.num_experts, module.top_k
            else:
                dense += sum(p.numel() for p in own)
                dense_matmul += sum(p.numel() for p in own if p.dim() >= 2)
            if isinstance(module, Attention):
                kv_per_token += 2 * module.num_kv_heads * module.head_dim * bytes_per_param
                attention_per_key += 4 * module.num_heads * module.head_dim
        return cls(dense * bytes_per_param, dense_matmul, lm_head, expert, moe_layers, num_experts, top_k,
                   bytes_per_param, kv_per_token, attention_per_key)

    def expected_experts(self, num_tokens: int) -> float:
        """Distinct experts per MoE layer touched by `num_tokens` uniformly routed tokens."""
        if self.num_moe_layers == 0:
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** num_tokens)

    def weight_bytes(self, num_tokens: int) -> float:
        experts = self.num_moe_layers * self.expected_experts(num_tokens) * self.expert_params
        return self.dense_bytes + experts * self.bytes_per_param

    def matmul_flops(self, num_tokens: int, num_logits: int) -> float:
        per_token = self.dense_matmul_params + self.num_moe_layers * self.top_k * self.expert_params
        return 2 * per_token * num_tokens + 2 * self.lm_head_params * num_logits

    def attention_flops(self, query_len: int, context_len: int) -> float:
        keys_seen = query_len * (context_len - query_len) + query_len * (query_len + 1) // 2
        return self.attention_flops_per_key * keys_seen


def floor_seconds(cost: StepCost, workload: Workload, bandwidth: float, matmul_rate: float) -> tuple[float, float]:
    """(prefill, decode) seconds no implementation can beat; throughput.floor_seconds with per-step bytes."""
    n, p = workload.num_requests, workload.prompt_len
    prefill_flops = cost.matmul_flops(n * p, n) + n * cost.attention_flops(p, p)
    prefill_bytes = cost.weight_bytes(n * p) + n * p * cost.kv_bytes_per_token
    prefill = max(prefill_flops / matmul_rate, prefill_bytes / bandwidth)
    decode = 0.0
    for step in range(1, workload.output_len):
        context = p + step
        step_bytes = cost.weight_bytes(n) + n * context * cost.kv_bytes_per_token
        step_flops = cost.matmul_flops(n, n) + n * cost.attention_flops(1, context)
        decode += max(step_bytes / bandwidth, step_flops / matmul_rate)
    return prefill, decode


# ---- sections -----------------------------------------------------------------------------------------------
def run_model(args, model: str, roofline: dict, device: torch.device) -> dict:
    w1, single, batch8 = (QUICK_W1, QUICK_SINGLE, QUICK_BATCH8) if args.quick else (W1, SINGLE, BATCH8)
    hf_config = load_hf_config(model)
    cost = StepCost.of_model(hf_config, torch_dtype(args))
    bandwidth, matmul_rate = roofline["copy_bandwidth_bytes_per_s"], roofline["matmul_flops_per_s"]
    vocab = hf_config.vocab_size
    args.model = model   # build_llm reads it
    print(f"\n{model}: W1 {w1}, single stream {single}")
    llm = build_llm(args, max_num_seqs=w1.num_requests,
                    max_model_len=max(w1.prompt_len + w1.output_len, single.prompt_len + single.output_len),
                    quantization=args.quantization)
    result: dict = {"model": model, "dtype": args.dtype, "quantization": args.quantization,
                    "floors": f"{args.dtype} weights" + (f" (the run's weights are {args.quantization})"
                                                         if args.quantization else ""),
                    "step_cost": asdict(cost),
                    "weight_bytes_loaded": llm.llm_engine.runner.weight_bytes,
                    "expected_experts_per_moe_layer": {"decode_w1": cost.expected_experts(w1.num_requests),
                                                       "single_stream": cost.expected_experts(1)}}
    warm_up(llm, w1, vocab)
    run = timed_generate(llm, random_prompts(w1, vocab, seed=0), w1.output_len)
    prefill, decode = floor_seconds(cost, w1, bandwidth, matmul_rate)
    floor_tps = w1.num_requests * w1.output_len / (prefill + decode)
    result["w1"] = {"workload": str(w1), "output_tokens_per_s": run["output_tokens_per_s"],
                    "total_tokens_per_s": run["total_tokens_per_s"], "floor_output_tokens_per_s": floor_tps,
                    "achieved_over_floor": run["output_tokens_per_s"] / floor_tps, "floor_prefill_s": prefill,
                    "floor_decode_s": decode, "outputs_verified": run["outputs_verified"], "run": run}
    print(f"  W1 {run['output_tokens_per_s']:.1f} output tok/s, floor {floor_tps:.1f} "
          f"({run['output_tokens_per_s'] / floor_tps:.2f} of it)")
    run1 = timed_generate(llm, random_prompts(single, vocab, seed=1), single.output_len)
    _, decode1 = floor_seconds(cost, single, bandwidth, matmul_rate)
    floor_ms = 1e3 * decode1 / (single.output_len - 1)
    result["single_stream"] = {"workload": str(single), "ms_per_token": run1["median_tpot_ms"],
                               "tokens_per_s": 1e3 / run1["median_tpot_ms"], "floor_ms_per_token": floor_ms,
                               "floor_tokens_per_s": 1e3 / floor_ms,
                               "achieved_over_floor": floor_ms / run1["median_tpot_ms"],
                               "ttft_s": run1["median_ttft_s"], "outputs_verified": run1["outputs_verified"]}
    print(f"  single stream {run1['median_tpot_ms']:.2f} ms/token, floor {floor_ms:.2f} ms/token")
    run8 = timed_generate(llm, random_prompts(batch8, vocab, seed=2), batch8.output_len)
    _, decode8 = floor_seconds(cost, batch8, bandwidth, matmul_rate)
    floor8_ms = 1e3 * decode8 / (batch8.output_len - 1)
    result["batch8"] = {"workload": str(batch8), "ms_per_step": run8["median_tpot_ms"],
                        "output_tokens_per_s": batch8.num_requests * 1e3 / run8["median_tpot_ms"],
                        "floor_ms_per_step": floor8_ms, "achieved_over_floor": floor8_ms / run8["median_tpot_ms"],
                        "outputs_verified": run8["outputs_verified"]}
    print(f"  batch 8 {run8['median_tpot_ms']:.2f} ms/step, floor {floor8_ms:.2f} ms/step")
    result["kv_cache"] = kv_cache_info(llm, args)
    del llm
    free_device_memory(device)
    return result


def _kernel_tokens(args) -> tuple[int, ...]:
    return QUICK_KERNEL_TOKENS if args.quick else KERNEL_TOKENS


def _fused_flops(num_tokens: int, top_k: int, hidden: int, inter: int) -> int:
    """The experts' gate, up and down products for `num_tokens` tokens of top_k routing."""
    return 2 * num_tokens * top_k * 3 * hidden * inter


def _kernel_operands(args, device: torch.device):
    """Qwen3-30B-A3B's expert shapes (tiny ones with --quick), the token counts, the dtype, a seeded generator
    and the stacked expert weights."""
    config = load_hf_config("qwen3-30b-a3b")
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    if args.quick:   # the interpreter on the CPU: tiny shapes
        num_experts, top_k, hidden, inter = 8, 2, 32, 16
    tokens = _kernel_tokens(args)
    dtype = torch_dtype(args)
    g = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, generator=g).mul_(0.02).to(dtype)
    w2 = torch.randn(num_experts, hidden, inter, device=device, generator=g).mul_(0.02).to(dtype)
    return num_experts, top_k, hidden, inter, tokens, dtype, g, w13, w2


def _kernel_seconds(args, device: torch.device, fn) -> float:
    if device.type == "cuda":
        from minivllm.kernels import tuning
        return tuning.device_seconds(fn, calls=5, repeats=5 if args.quick else 20)
    return time_median(fn, device, repeats=3)


def rerun_largest_kernel(args, device: torch.device) -> float:
    """TFLOP/s of the fused path at the kernel table's largest token count, timed again (after the models ran)."""
    from minivllm.kernels.fused_moe import fused_experts
    from minivllm.layers.fused_moe import select_experts
    num_experts, top_k, hidden, inter, tokens, dtype, g, w13, w2 = _kernel_operands(args, device)
    m = tokens[-1]
    x = torch.randn(m, hidden, device=device, generator=g).to(dtype)
    weights, ids = select_experts(torch.randn(m, num_experts, device=device, generator=g), top_k, renormalize=True)
    seconds = _kernel_seconds(args, device, lambda: fused_experts(x, w13, w2, weights, ids))
    del w13, w2
    free_device_memory(device)
    return _fused_flops(m, top_k, hidden, inter) / seconds / 1e12


def run_kernel(args, roofline: dict, device: torch.device) -> list[dict]:
    """fused_experts (the path and tile the tuner picks, as the engine runs it), each path forced, and the
    looped reference, against the floor, at Qwen3-30B-A3B's expert shapes. On the GPU every fused time is a
    CUDA-graph replay (as a decode step runs it: no launch overhead); the loop is timed eagerly."""
    from minivllm.kernels import moe_grouped_mm
    from minivllm.kernels.fused_moe import (GEMV_MAX_SLOTS, GEMV_TILES, _grouped_experts, fused_experts,
                                            fused_experts_reference)
    from minivllm.kernels.moe_sort import ALIGN_KERNEL_MAX_SLOTS, align_one_program, moe_align_block_size, sort_slots
    from minivllm.layers.fused_moe import select_experts
    num_experts, top_k, hidden, inter, tokens, dtype, g, w13, w2 = _kernel_operands(args, device)
    element = w13.element_size()

    def timed(fn) -> float:
        return _kernel_seconds(args, device, fn)

    rows = []
    for m in tokens:
        x = torch.randn(m, hidden, device=device, generator=g).to(dtype)
        logits = torch.randn(m, num_experts, device=device, generator=g)
        weights, ids = select_experts(logits, top_k, renormalize=True)
        touched = int(ids.unique().numel())
        fused_s = timed(lambda: fused_experts(x, w13, w2, weights, ids))
        grouped_s = timed(lambda: fused_experts(x, w13, w2, weights, ids, tile="grouped"))
        gemv = {}
        if m * top_k <= GEMV_MAX_SLOTS:
            for tile in GEMV_TILES[:2] if args.quick else GEMV_TILES:
                gemv[tile] = timed(lambda tile=tile: fused_experts(x, w13, w2, weights, ids, tile=tile))
        # The grouped path's sort as a decode batch (16-row tiles) or a prefill (128) pads it: the counting sort,
        # the one-program kernel (up to 1,024 slots) and the tensor operations.
        block_m = 16 if m * top_k <= 16 * num_experts else 128
        extra = {"sort_us": 1e6 * timed(lambda: sort_slots(ids, num_experts, block_m))}
        if m * top_k <= 1024:
            extra["align_kernel_us"] = 1e6 * timed(lambda: align_one_program(ids, num_experts, block_m))
        if m * top_k > ALIGN_KERNEL_MAX_SLOTS:
            extra["sort_tensor_ops_us"] = 1e6 * timed(lambda: moe_align_block_size(ids, num_experts, block_m))
        if m * top_k > 64 * num_experts and moe_grouped_mm.supported(x, w13, None):
            extra["grouped_mm_us"] = 1e6 * timed(
                lambda: _grouped_experts(x, w13, w2, weights, ids, None, None, moe_grouped_mm.GROUPED_MM))
        looped_s = time_median(lambda: fused_experts_reference(x, w13, w2, weights, ids), device,
                               repeats=3 if args.quick else 10)
        diff = (fused_experts(x, w13, w2, weights, ids).float()
                - fused_experts_reference(x, w13, w2, weights, ids).float()).abs().max().item()
        floor_bytes = touched * 3 * hidden * inter * element + 2 * m * hidden * element
        flops = _fused_flops(m, top_k, hidden, inter)
        floor_s = max(floor_bytes / roofline["copy_bandwidth_bytes_per_s"], flops / roofline["matmul_flops_per_s"])
        best_gemv = min(gemv, key=gemv.get) if gemv else None
        rows.append({"tokens": m, "experts_touched": touched, "fused_us": 1e6 * fused_s,
                     "grouped_us": 1e6 * grouped_s, "gemv_us": 1e6 * gemv[best_gemv] if gemv else None,
                     "gemv_tile": list(best_gemv) if best_gemv else None,
                     "gemv_us_by_tile": {str(tile): 1e6 * t for tile, t in gemv.items()}, "looped_us": 1e6 * looped_s,
                     "floor_us": 1e6 * floor_s, "speedup_over_looped": looped_s / fused_s,
                     "achieved_over_floor": floor_s / fused_s, "fused_tflops": flops / fused_s / 1e12,
                     "fused_gb_per_s": floor_bytes / fused_s / 1e9, "max_abs_diff_vs_looped": diff, **extra})
    print_table([{k: v for k, v in row.items() if k != "gemv_us_by_tile"} for row in rows],
                f"fused MoE kernel: E {num_experts}, top {top_k}, hidden {hidden}, expert {inter}, {dtype}")
    return rows


# ---- main ---------------------------------------------------------------------------------------------------
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="qwen3-30b-a3b,gpt2-xl",
                        help="comma-separated dummy config names or config.json paths")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--quick", action="store_true", help="tiny workloads and kernel shapes (smoke test)")
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument("--quantization", default=None, choices=["fp8", "int8"],
                        help="the models' weights (experts included) in 8 bits; results keyed <model>-<quantization>")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--cpu-kv-cache-memory", type=int, default=64 * 2**20)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Each section is recorded on its own: one that fails leaves its error in the JSON, not a crash."""
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    meta = run_metadata(device)
    path = args.out / f"models_{device_slug(meta['device'])}.json"
    print(f"minivllm model-family benchmark | device {meta['device']} | commit {meta['commit']} | {meta['date']}")
    roofline = measure_roofline(device, torch_dtype(args))
    result: dict = {**meta, **roofline, "models": {}}
    # The kernel table first, in the thermal state of the roofline it is judged against: after W1 on an MoE
    # model the GPU runs the same kernels slower (the 4,096-token row is timed again at the end).
    sections = [] if args.skip_kernel else [("moe_kernel", lambda: run_kernel(args, roofline, device))]
    sections += [(name, lambda name=name: run_model(args, name, roofline, device))
                 for name in args.models.split(",") if name]
    if not args.skip_kernel and len(sections) > 1:
        sections.append(("moe_kernel_after_models", lambda: rerun_largest_kernel(args, device)))
    for name, section in sections:
        try:
            value = section()
        except Exception as e:   # keep the other sections' numbers: this runs once, unattended
            traceback.print_exc()
            value = {"error": f"{type(e).__name__}: {e}"}
            free_device_memory(device)
        if name == "moe_kernel_after_models":
            result[f"moe_kernel_m{_kernel_tokens(args)[-1]}_tflops_after_models"] = value
        elif name == "moe_kernel":
            result["moe_kernel"] = value
            for row in value if isinstance(value, list) else []:   # the figures people look for first
                if row["tokens"] in (1, 8):
                    result[f"moe_kernel_m{row['tokens']}_over_floor"] = row["achieved_over_floor"]
                if row["tokens"] == 4096:
                    result["moe_kernel_m4096_tflops"] = row["fused_tflops"]
        else:
            key = f"{name}-{args.quantization}" if args.quantization else name
            result["models"][key] = value
            headline = HEADLINE_NAMES.get(name)
            if headline and "error" not in value:
                headline += f"_{args.quantization}" if args.quantization else ""
                for part, label in (("single_stream", "single"), ("batch8", "b8"), ("w1", "w1")):
                    result[f"{headline}_{label}_over_floor"] = value[part]["achieved_over_floor"]
        result["tuner_us"] = tuner_us("dense_gemv", "moe_experts", "moe_grouped")
        write_json(path, result)
    summary = []
    for name, value in result["models"].items():
        if "error" not in value:
            summary += [{"metric": f"{name} W1 output tok/s", "value": value["w1"]["output_tokens_per_s"]},
                        {"metric": f"{name} W1 achieved / floor", "value": value["w1"]["achieved_over_floor"]},
                        {"metric": f"{name} single stream tok/s", "value": value["single_stream"]["tokens_per_s"]},
                        {"metric": f"{name} single stream achieved / floor",
                         "value": value["single_stream"]["achieved_over_floor"]}]
    print_table(summary, f"summary ({time.perf_counter() - started:.0f} s in all)")
    return result


if __name__ == "__main__":
    main()
