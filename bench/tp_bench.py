"""Tensor and data parallelism on two GPUs, in one command (results in tp_<gpu>x2.json):

    python bench/tp_bench.py --out bench/results            # on 2 H200s: 8B TP=1 / TP=2 / DP=2, 70B TP=2, NCCL
    python bench/tp_bench.py --skip-70b --eager --update --out bench/results
                                                             # 8B only, plus TP = 2 without CUDA graphs
    python bench/tp_bench.py --skip-8b --int4 --serve --update --out bench/results
                                                             # 70B bf16, 70B int4 and `minivllm serve` of the 70B,
                                                             # merged into the existing file (per-part commands)
    python bench/tp_bench.py --device cpu --quick --out /tmp # the same pipeline on the CPU (gloo, tiny-llama)

Every configuration runs in fresh processes (a process holds one tensor-parallel group): a child
`--child engine` builds one engine (dummy weights) and times W1 (64 x 512 -> 256) and a single stream
(1 x 512 -> 128) like bench/throughput.py; DP = 2 is two such children, one per GPU
(CUDA_VISIBLE_DEVICES), each serving a whole W1 (twice the traffic in all: data parallelism scales
traffic, not one batch), started together behind a file barrier and timed from the first start to the
last finish. `--child allreduce` times the engine's all-reduce (NCCL) on 2 GPUs, as CUDA graph replays,
for the tensor shapes tensor parallelism sends (2 per layer: after o_proj and after down_proj, each
[tokens, hidden]) and the bus bandwidth of a large one (busbw = bytes / time * 2 (n - 1) / n, NCCL's
definition). All-reduce time per layer and its share of a step are those times against the measured
TP = 2 step time (median time per output token at batch 1 and at W1's batch of 64).

`--int4` adds the 70B with GPTQ-layout int4 weights (group 128, symmetric) at TP = 2. `--serve` starts
`minivllm serve <70B> --load-format dummy --tensor-parallel-size 2`, checks one completion and one stream
through the openai SDK, then runs bench/serve.py's client at 4 and 64 concurrent users (512 -> 256).

Floors: the roofline of bench/throughput.py with both GPUs' bandwidth and matmul rate (each GPU reads
half the weights and does half the FLOPs), all-reduce not counted: the floor says what the hardware
allows, the all-reduce section says how much of the gap the communication explains.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch  # noqa: E402

from bench.common import ModelShape, load_hf_config, print_table, run_metadata, write_json  # noqa: E402

FULL = dict(model_8b="llama-3-8b", model_70b="llama-3-70b", w1=(64, 512, 256), single=(1, 512, 128))
QUICK = dict(model_8b="tiny-llama", model_70b="tiny-llama", w1=(4, 32, 8), single=(1, 32, 4))


# ---- children ----------------------------------------------------------------------------------------------------
def child_engine(args) -> dict:
    """One engine: roofline (TP = 1 only), W1 and single stream (W1 alone for a data-parallel replica)."""
    from bench.throughput import Workload, build_llm, measure_roofline, random_prompts, timed_generate, warm_up
    device = torch.device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    result = {**run_metadata(device), "model": args.model, "tp": args.tp}
    w1, single = Workload(*args.w1), Workload(*args.single)
    options = SimpleNamespace(model=args.model, dtype=args.dtype, device=args.device, max_num_batched_tokens=8192,
                              gpu_memory_utilization=0.9, cpu_kv_cache_memory=64 * 2**20)
    extra = {"tensor_parallel_size": args.tp}
    if args.cuda_graph_max_tokens is not None:
        extra["cuda_graph_max_tokens"] = args.cuda_graph_max_tokens
    if args.enforce_eager:
        extra["enforce_eager"] = True
    if args.quantization:
        extra["quantization"] = args.quantization
    started = time.perf_counter()
    llm = build_llm(options, max_num_seqs=w1.num_requests, max_model_len=max(w1.prompt_len + w1.output_len,
                                                                             single.prompt_len + single.output_len),
                    **extra)
    result["engine_build_s"] = time.perf_counter() - started
    vocab = llm.llm_engine.vocab_size
    warm_up(llm, w1, vocab)
    # Data parallelism scales traffic: each replica serves a whole W1 (its own prompts).
    prompts = random_prompts(w1, vocab, seed=args.replica)
    if args.barrier:   # data parallel: all replicas start together
        Path(args.barrier, f"ready{args.replica}").touch()
        while len(list(Path(args.barrier).glob("ready*"))) < args.replicas:
            time.sleep(0.01)
    result["w1_start_wall"] = time.time()
    result["w1"] = timed_generate(llm, prompts, w1.output_len)
    result["w1_end_wall"] = time.time()
    if not args.barrier:
        result["single"] = timed_generate(llm, random_prompts(single, vocab, seed=1), single.output_len)
    if args.tp > 1:   # the step profile: where the all-reduces sit in real steps
        try:
            result["profile"] = [profile_collectives(llm, Workload(n, w1.prompt_len, min(64, w1.output_len)), vocab,
                                                     device, seed=2 + n) for n in (1, w1.num_requests)]
        except Exception as e:   # the numbers above stand without it
            result["profile_error"] = repr(e)
    llm.llm_engine.shutdown()
    if args.roofline:   # after the engine, whose KV cache sizing must not see the probe's memory
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["roofline"] = measure_roofline(device, dtype)
    return result


# kernel name fragments -> the part of a decode step they belong to (first match wins)
KERNEL_KINDS = (("allreduce", ("allreduce", "gloo:all_reduce")),
                ("gemm", ("nvjet", "gemm", "gemv", "splitkreduce", "cutlass", "matmul", "addmm", "linear")),
                ("attention", ("decode_", "prefill", "attention", "write_kv", "rotary")))


def kernel_kind(name: str) -> str:
    name = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in name for p in parts)), "other")


def profile_collectives(llm, workload, vocab: int, device: torch.device, seed: int) -> dict:
    """Run `workload` under torch.profiler on the driver and take its decode steps apart: each step runs
    from one input broadcast (NCCL's Broadcast kernel, once a step) to the next; per step, device time by
    kind of kernel (all-reduce, GEMM, attention with its KV write and rotary, other) and the time the
    device idled. Medians over the decode steps (the prefill and the last two steps left out). On a CPU
    only gloo's all-reduce is timed (on the host), steps ending at the gather of their logits."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    from bench.throughput import random_prompts, timed_generate
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run = timed_generate(llm, random_prompts(workload, vocab, seed), workload.output_len)
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    if cuda:
        kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        starts = [e["ts"] for e in kernels if "broadcast" in e["name"].lower()]
    else:   # gloo's ops; a step ends with the gather of its logits
        kernels = [e for e in events if e.get("name", "").startswith("gloo:") and "dur" in e]
        starts = [e["ts"] + e["dur"] for e in kernels if e["name"] == "gloo:gather"]
    kernels.sort(key=lambda e: e["ts"])
    starts.sort()
    steps = []
    for begin, end in list(zip(starts, starts[1:]))[1:-2]:
        inside = [e for e in kernels if begin <= e["ts"] < end]
        step = {"step_us": end - begin, "allreduce_us": 0.0, "gemm_us": 0.0, "attention_us": 0.0, "other_us": 0.0}
        covered, reach, calls = 0.0, begin, []
        for e in inside:
            kind = kernel_kind(e["name"])
            step[f"{kind}_us"] += e["dur"]
            if kind == "allreduce":
                calls.append(e["dur"])
            covered += max(0.0, e["ts"] + e["dur"] - max(e["ts"], reach))
            reach = max(reach, e["ts"] + e["dur"])
        step["idle_us"] = step["step_us"] - covered if cuda else None
        step["allreduce_calls"], step["allreduce_call_us"] = len(calls), statistics.median(calls) if calls else None
        steps.append(step)
    row = {"workload": str(workload), "wall_s": run["elapsed_s"], "decode_steps": len(steps)}
    for key in ("step_us", "allreduce_us", "allreduce_calls", "allreduce_call_us", "gemm_us", "attention_us",
                "other_us", "idle_us"):
        values = [s[key] for s in steps if s[key] is not None]
        row[key] = statistics.median(values) if values else None
    if row["allreduce_us"] is not None and row["step_us"]:
        row["allreduce_share"] = row["allreduce_us"] / row["step_us"]
    return row


def _allreduce_worker(rank: int, world: int, port: int, device_type: str, shapes: list, queue) -> None:
    """Per shape: the engine's all-reduce (`tensor_model_parallel_all_reduce`, NCCL on CUDA) timed as 20
    calls replayed from a CUDA graph, as decode steps replay it (device time, no launch cost; host-timed
    loops on a CPU)."""
    import torch.distributed as dist

    from minivllm.distributed import destroy_distributed, init_distributed, tensor_model_parallel_all_reduce
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    cuda = device_type == "cuda"
    init_distributed(rank, world, "nccl" if cuda else "gloo", 300)
    device = torch.device(device_type, rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    def time_calls(fn, x, calls=20) -> float:
        if not cuda:
            started = time.perf_counter()
            for _ in range(calls):
                fn(x)
            return (time.perf_counter() - started) / calls
        for _ in range(3):
            fn(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn(x)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            dist.barrier()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        return sorted(times)[len(times) // 2]

    rows = []
    for name, numel in shapes:
        x = torch.randn(numel, device=device).to(dtype)
        seconds = time_calls(tensor_model_parallel_all_reduce, x)
        nbytes = numel * x.element_size()
        rows.append({"shape": name, "bytes": nbytes, "time_us": seconds * 1e6,
                     "bus_bandwidth_GBps": nbytes / seconds * 2 * (world - 1) / world / 1e9})
    if rank == 0:
        queue.put(rows)
    destroy_distributed()


def child_allreduce(args) -> dict:
    import torch.multiprocessing as mp
    from minivllm.worker.executor import _free_port
    shapes = []
    for model in sorted({args.model_8b, args.model_70b}):
        hidden = load_hf_config(model).hidden_size
        for tokens in sorted({1, args.w1[0], 512}):
            shapes.append((f"{model} [{tokens}, {hidden}]", tokens * hidden))
    shapes.append(("256 MiB", (256 << 20) // (2 if args.device == "cuda" else 4)))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, 2, port, args.device, shapes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return {"allreduce": rows}


# ---- the driver ----------------------------------------------------------------------------------------------------
def _child(args, kind: str, out: Path, name: str, extra: list[str], env: dict | None = None,
           wait: bool = True, timeout_s: float = 300):
    """Run one child; returns its exit code (-9 after `timeout_s`), or the process if not waiting."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--device", args.device,
           "--dtype", args.dtype, "--result", str(out / f"{name}.json"), "--model-8b", args.model_8b,
           "--model-70b", args.model_70b, "--w1", *map(str, args.sizes["w1"])] + extra
    print(f"\n== {name}: {' '.join(cmd[2:])}", flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    if not wait:
        return proc
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"   {name} took more than {timeout_s:.0f} s: killed")
        proc.kill()
        proc.wait()
        return -9


def _load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _engine_args(sizes: dict, model: str, tp: int, **flags) -> list[str]:
    argv = ["--model", model, "--tp", str(tp), "--single", *map(str, sizes["single"])]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return argv


def run_engine(args, sizes, out, name, model, tp, timeout_s: float = 240, **flags) -> dict | None:
    """A child engine; if it fails fast (CUDA graphs under TP, say), once more eagerly (the result says so)."""
    started = time.perf_counter()
    if _child(args, "engine", out, name, _engine_args(sizes, model, tp, **flags), timeout_s=timeout_s) == 0:
        return _load(out, name)
    if args.device == "cuda" and time.perf_counter() - started < 120:
        print(f"   {name} failed; retrying with --enforce-eager")
        if _child(args, "engine", out, name, _engine_args(sizes, model, tp, enforce_eager=True, **flags),
                  timeout_s=timeout_s) == 0:
            return {**_load(out, name), "enforce_eager_fallback": True}
    return None


def run_dp(args, sizes, out, model) -> dict | None:
    barrier = Path(tempfile.mkdtemp(prefix="dp_barrier_"))
    procs = [_child(args, "engine", out, f"dp2_r{r}", _engine_args(sizes, model, 1, replica=r, replicas=2,
                                                                    barrier=barrier),
                    env={"CUDA_VISIBLE_DEVICES": str(r)} if args.device == "cuda" else None, wait=False)
             for r in range(2)]
    try:
        if any(p.wait(timeout=240) != 0 for p in procs):
            return None
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return None
    parts = [_load(out, f"dp2_r{r}") for r in range(2)]
    elapsed = max(p["w1_end_wall"] for p in parts) - min(p["w1_start_wall"] for p in parts)
    tokens = sum(p["w1"]["num_output_tokens"] for p in parts)
    return {"w1_output_tokens_per_s": tokens / elapsed, "elapsed_s": elapsed, "num_output_tokens": tokens,
            "replicas": [p["w1"] for p in parts]}


def run_serve(args, sizes, work: Path, model: str, tp: int) -> dict | None:
    """`minivllm serve MODEL --load-format dummy --tensor-parallel-size TP`: one completion and one stream
    through the openai SDK, then bench/serve.py's client at 4 and 64 users (W1's lengths). None on failure
    (the log says why)."""
    import asyncio

    from openai import OpenAI

    from bench import serve
    w1 = sizes["w1"]
    options = SimpleNamespace(model=model, load_format="dummy", api_key=None, dataset="random", input_len=w1[1],
                              output_len=w1[2], range_ratio=0.0, warmup=2, timeout=600.0, seed=0, num_prompts=0,
                              request_rate=None, concurrency=None,
                              server_args=f"--tensor-parallel-size {tp} --max-num-seqs {w1[0]} --max-model-len "
                                          f"{w1[1] + w1[2] + 64} --cuda-graph-max-tokens 512 --dtype {args.dtype}")
    log = work / "serve_70b.log"
    started = time.perf_counter()
    port = serve.free_port()
    process = serve.start_server(options, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(serve.wait_healthy(url, process, 900, log))
        ready_s = time.perf_counter() - started
        client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=300)
        served = client.models.list().data[0].id
        prompt = list(range(100, 164))
        completion = client.completions.create(model=served, prompt=prompt, max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True})
        chunks = [c for c in client.completions.create(model=served, prompt=prompt, max_tokens=16, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True})]
        sdk = {"completion_tokens": completion.usage.completion_tokens, "finish_reason": completion.choices[0].finish_reason,
               "stream_chunks": len(chunks)}
        if sdk["completion_tokens"] != 16:
            raise RuntimeError(f"the openai SDK's completion has {sdk['completion_tokens']} tokens, 16 asked")
        levels = {}
        for users, requests in ((4, 16), (w1[0], 2 * w1[0])):   # 4 rounds at 4 users, 2 at 64
            run = SimpleNamespace(**{**vars(options), "concurrency": str(users), "num_prompts": requests,
                                     "warmup": 0 if levels else options.warmup})
            levels.update(asyncio.run(serve.benchmark(run, url))[1]["levels"])
        return {"model": model, "tensor_parallel_size": tp, "server_ready_s": ready_s, "openai_sdk": sdk,
                "levels": levels}
    except Exception as e:
        print(f"   serving {model} failed: {e!r}\n{log.read_text()[-3000:] if log.exists() else ''}")
        return None
    finally:
        serve.stop_server(process)


def summarize(args, sizes, tp1, tp2, dp2, big, ar, big_int4=None, served=None, eager=None) -> dict:
    from bench.throughput import Workload, floor_seconds
    roofline = (tp1 or big or {}).get("roofline")
    result = {**(tp1 or tp2 or big or {}), "workload_w1": str(Workload(*sizes["w1"])),
              "workload_single": str(Workload(*sizes["single"])), "roofline_per_gpu": roofline}
    for key in ("w1", "single", "w1_start_wall", "w1_end_wall", "tp", "model", "roofline", "engine_build_s"):
        result.pop(key, None)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]

    def floors(model: str, gpus: int) -> dict:
        if roofline is None:
            return {}
        shape = ModelShape.from_hf_config(load_hf_config(model), dtype)
        bw, rate = gpus * roofline["copy_bandwidth_bytes_per_s"], gpus * roofline["matmul_flops_per_s"]
        w1, single = Workload(*sizes["w1"]), Workload(*sizes["single"])
        w1_floor = w1.num_requests * w1.output_len / sum(floor_seconds(shape, w1, bw, rate))
        single_floor = 1e3 * floor_seconds(shape, single, bw, rate)[1] / (single.output_len - 1)
        return {"floor_w1_output_tokens_per_s": w1_floor, "floor_single_tokens_per_s": 1e3 / single_floor}

    def engine_row(run: dict | None, model: str, gpus: int, with_floor: bool = True) -> dict | None:
        if run is None:
            return None
        row = {"w1_output_tokens_per_s": run["w1"]["output_tokens_per_s"],
               "w1_median_tpot_ms": run["w1"].get("median_tpot_ms"),
               "single_tokens_per_s": 1e3 / run["single"]["median_tpot_ms"],
               "single_ms_per_token": run["single"]["median_tpot_ms"], "single_ttft_s": run["single"]["median_ttft_s"],
               "engine_build_s": run["engine_build_s"], "enforce_eager_fallback": run.get("enforce_eager_fallback", False),
               **(floors(model, gpus) if with_floor else {})}
        if "floor_w1_output_tokens_per_s" in row:
            row["w1_over_floor"] = row["w1_output_tokens_per_s"] / row["floor_w1_output_tokens_per_s"]
            row["single_over_floor"] = row["single_tokens_per_s"] / row["floor_single_tokens_per_s"]
        return row

    result["tp1_8b"] = engine_row(tp1, sizes["model_8b"], 1)
    result["tp2_8b"] = engine_row(tp2, sizes["model_8b"], 2)
    result["dp2_8b"] = dp2
    big_tp = getattr(args, "big_tp", 2)
    big_key = f"tp{big_tp}_70b"
    result[big_key] = engine_row(big, sizes["model_70b"], big_tp)
    result["tp2_70b_int4"] = engine_row(big_int4, sizes["model_70b"], 2, with_floor=False)   # bf16 floors only
    result["tp2_70b_serve"] = served
    result["tp2_eager_8b"] = engine_row(eager, sizes["model_8b"], 2)
    if tp1 and tp2:
        result["tp2_over_tp1_w1"] = result["tp2_8b"]["w1_output_tokens_per_s"] / result["tp1_8b"]["w1_output_tokens_per_s"]
        result["tp2_over_tp1_single"] = result["tp2_8b"]["single_tokens_per_s"] / result["tp1_8b"]["single_tokens_per_s"]
    if tp1 and dp2:
        result["dp2_over_tp1_w1"] = dp2["w1_output_tokens_per_s"] / result["tp1_8b"]["w1_output_tokens_per_s"]
    for key, run in (("tp2_8b", tp2), (big_key, big)):
        if run is not None:
            result[f"{key}_step_profile"] = run.get("profile") or run.get("profile_error")
    if ar:
        result["allreduce"] = ar["allreduce"]
        result["allreduce_bus_bandwidth_GBps"] = ar["allreduce"][-1]["bus_bandwidth_GBps"]
        by_shape = {row["shape"]: row["time_us"] for row in ar["allreduce"]}
        shares = []
        for label, run, model in (("8b", tp2, sizes["model_8b"]), ("70b", big, sizes["model_70b"])):
            if run is None:
                continue
            cfg = load_hf_config(model)
            for batch, ms in ((1, run["single"]["median_tpot_ms"]), (sizes["w1"][0], run["w1"].get("median_tpot_ms"))):
                per_call = by_shape.get(f"{model} [{batch}, {cfg.hidden_size}]")
                if per_call is None or not ms:
                    continue
                per_layer_us = 2 * per_call
                shares.append({"model": label, "decode_batch": batch, "allreduce_per_layer_us": per_layer_us,
                               "layers": cfg.num_hidden_layers, "step_ms": ms,
                               "allreduce_share_of_step": per_layer_us * cfg.num_hidden_layers / (ms * 1e3)})
        result["allreduce_share"] = shares
    headline(result, sizes, big_tp)
    return result


def headline(result: dict, sizes: dict, big_tp: int = 2) -> None:
    """The figures people look for first, as top-level keys (None where a run is missing)."""
    tp1, tp2, big = result.get("tp1_8b") or {}, result.get("tp2_8b") or {}, result.get(f"tp{big_tp}_70b") or {}
    result.update(tp1_w1_out_tok_s=tp1.get("w1_output_tokens_per_s"), tp2_w1_out_tok_s=tp2.get("w1_output_tokens_per_s"),
                  dp2_w1_out_tok_s=(result.get("dp2_8b") or {}).get("w1_output_tokens_per_s"),
                  tp1_single_tok_s=tp1.get("single_tokens_per_s"), tp2_single_tok_s=tp2.get("single_tokens_per_s"))
    result.setdefault("tp2_over_tp1_w1", None)
    result.setdefault("tp2_over_tp1_single", None)
    result.setdefault("dp2_over_tp1_w1", None)
    share = [row for row in result.get("allreduce_share", []) if row["model"] == "8b" and row["decode_batch"] == 1]
    result["allreduce_us_per_layer_batch1"] = share[0]["allreduce_per_layer_us"] if share else None
    int4, served = result.get("tp2_70b_int4") or {}, result.get("tp2_70b_serve") or {}
    eager = result.get("tp2_eager_8b") or {}
    if eager and tp2:
        result["tp2_eager_over_graphed_w1"] = eager["w1_output_tokens_per_s"] / tp2["w1_output_tokens_per_s"]
    if int4:
        result.update(llama70b_int4_tp2_w1_out_tok_s=int4.get("w1_output_tokens_per_s"),
                      llama70b_int4_tp2_single_tok_s=int4.get("single_tokens_per_s"))
    if served:
        levels = served["levels"]
        result.update(llama70b_tp2_serve_ttft_p50_ms_c4=levels["4"]["ttft_ms"]["p50"],
                      llama70b_tp2_serve_itl_p95_ms_c64=levels[str(sizes["w1"][0])]["itl_ms"]["p95"])
    if big:
        result.update({f"llama70b_tp{big_tp}_w1_out_tok_s": big.get("w1_output_tokens_per_s"),
                       f"llama70b_tp{big_tp}_w1_over_floor": big.get("w1_over_floor"),
                       f"llama70b_tp{big_tp}_single_tok_s": big.get("single_tokens_per_s"),
                       f"llama70b_tp{big_tp}_single_over_floor": big.get("single_over_floor")})


def merged(old: dict, new: dict) -> dict:
    """`old` with every measured value of `new` (the parts run now) in place of its own; `parts` says which
    command, commit and date made each part."""
    if "parts" not in old:   # a file from a full run: its parts share its command
        old["parts"] = {part: {k: old.get(k) for k in ("commit", "date", "command")} for part, key in
                        (("8b", "tp1_8b"), ("70b", "tp2_70b")) if old.get(key)}
    out = dict(old)
    for key, value in new.items():
        if value is None:
            continue
        if key == "allreduce_share":   # rows of the models run now replace theirs only
            fresh = {(row["model"], row["decode_batch"]) for row in value}
            value = [row for row in old.get(key, []) if (row["model"], row["decode_batch"]) not in fresh] + value
        out[key] = {**old["parts"], **value} if key == "parts" else value
    return out


def plot(result: dict, path: Path) -> bool:
    """Left: all-reduce time against message size with the decode messages marked; middle: TP = 1 / TP = 2
    / DP = 2 W1 and single stream against TP = 1; right: a TP = 2 decode step by kind of kernel (driver)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return False
    rows = sorted(result.get("allreduce", []), key=lambda r: r["bytes"])
    key = "nccl_us" if rows and "nccl_us" in rows[0] else "time_us"
    fig, (left, right, steps) = plt.subplots(1, 3, figsize=(17, 4.5))
    left.plot([r["bytes"] for r in rows], [r[key] for r in rows], "o-")
    for r in rows:
        left.annotate(r["shape"], (r["bytes"], r[key]), fontsize=7, xytext=(4, -10), textcoords="offset points")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("message bytes")
    left.set_ylabel("all-reduce µs (CUDA graph replay)")
    left.set_title(f"all-reduce, bus bandwidth at 256 MiB {result.get('allreduce_bus_bandwidth_GBps', 0):.0f} GB/s")
    left.grid(True, which="both", alpha=0.3)
    labels, w1, single = [], [], []
    base_w1, base_single = result.get("tp1_w1_out_tok_s"), result.get("tp1_single_tok_s")
    for label, w, s in (("TP = 1", base_w1, base_single), ("TP = 2", result.get("tp2_w1_out_tok_s"),
                                                           result.get("tp2_single_tok_s")),
                        ("DP = 2", result.get("dp2_w1_out_tok_s"), None)):
        if w and base_w1:
            labels.append(label)
            w1.append(w / base_w1)
            single.append(s / base_single if s and base_single else 0.0)
    x = range(len(labels))
    right.bar([i - 0.2 for i in x], w1, 0.4, label="W1")
    right.bar([i + 0.2 for i in x], single, 0.4, label="single stream")
    right.axhline(2.0, color="gray", ls=":", lw=1)
    right.set_xticks(list(x), labels)
    right.set_ylabel("× TP = 1")
    right.set_title("scaling on 2 GPUs")
    right.legend()
    profile = [row for row in result.get("tp2_8b_step_profile") or [] if isinstance(row, dict) and "gemm_us" in row]
    bottom = [0.0] * len(profile)
    for kind in ("gemm", "attention", "allreduce", "other", "idle"):
        values = [(row.get(f"{kind}_us") or 0.0) / 1e3 for row in profile]
        steps.bar(range(len(profile)), values, 0.6, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    steps.set_xticks(range(len(profile)), [f"batch {row['workload'].split()[0]}" for row in profile])
    steps.set_ylabel("ms per decode step, median of each kind")
    steps.set_title("TP = 2 decode step, driver's device")
    steps.legend(fontsize=8)
    fig.suptitle(f"{result.get('device', '')}: dummy Llama-3-8B bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def gpu_tag() -> str:
    """h100 / h200 / ... from the first GPU's name."""
    name = torch.cuda.get_device_name(0).lower()
    return next((t for t in ("h200", "h100", "a100", "l40s") if t in name), name.split()[-1])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--quick", action="store_true", help="tiny-llama and small workloads (CPU smoke run)")
    p.add_argument("--skip-70b", action="store_true")
    p.add_argument("--skip-8b", action="store_true", help="only the 70B run and the all-reduce timings")
    p.add_argument("--plot", type=Path, default=None, help="only draw the PNG of an existing tp_*.json")
    p.add_argument("--tag", default=None, help="file name tp_<tag>.json (default h200x2 on CUDA, cpu)")
    # children
    p.add_argument("--child", choices=["engine", "allreduce"], default=None)
    p.add_argument("--result", type=Path, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--model-8b", default=None)
    p.add_argument("--model-70b", default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--w1", type=int, nargs=3, default=None)
    p.add_argument("--single", type=int, nargs=3, default=None)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--barrier", default=None)
    p.add_argument("--roofline", action="store_true")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default=None)
    p.add_argument("--eager", action="store_true", help="also the 8B at TP = 2 with enforce_eager (no CUDA graphs)")
    p.add_argument("--int4", action="store_true", help="also the 70B with int4 (GPTQ layout) weights at TP = 2")
    p.add_argument("--serve", action="store_true", help="also serve the 70B at TP = 2 (openai SDK + serve.py)")
    p.add_argument("--big-tp", type=int, default=2,
                   help="the 70B's tensor-parallel size (keys tp<N>_70b, llama70b_tp<N>_*; default file tp_<gpu>x<N>)")
    p.add_argument("--update", action="store_true",
                   help="merge the parts run into the existing tp_<tag>.json instead of replacing it")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return None
    if args.child:
        result = child_engine(args) if args.child == "engine" else child_allreduce(args)
        write_json(args.result, result)
        return None
    sizes = args.sizes = QUICK if args.quick else FULL
    args.model_8b, args.model_70b = sizes["model_8b"], sizes["model_70b"]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tp_bench_"))
    started = time.perf_counter()
    tp1 = tp2 = dp2 = big = None
    if not args.skip_8b:
        tp1 = run_engine(args, sizes, work, "tp1_8b", sizes["model_8b"], 1, roofline=True)
        tp2 = run_engine(args, sizes, work, "tp2_8b", sizes["model_8b"], 2)
        dp2 = run_dp(args, sizes, work, sizes["model_8b"])
    ar = _load(work, "allreduce") if _child(args, "allreduce", work, "allreduce", [], timeout_s=120) == 0 else None
    if not args.skip_70b:   # graphs up to 512 tokens only: capturing the 70B's mixed graphs costs minutes
        flags = {"roofline": True} if tp1 is None else {}
        big = run_engine(args, sizes, work, f"tp{args.big_tp}_70b", sizes["model_70b"], args.big_tp, timeout_s=330,
                         cuda_graph_max_tokens=512, **flags)
    big_int4 = served = eager = None
    if args.eager:
        eager = run_engine(args, sizes, work, "tp2_eager_8b", sizes["model_8b"], 2, enforce_eager=True)
    if args.int4:
        flags = {"roofline": True} if tp1 is None and big is None else {}
        big_int4 = run_engine(args, sizes, work, "tp2_70b_int4", sizes["model_70b"], 2, timeout_s=330,
                              cuda_graph_max_tokens=512, quantization="gptq", **flags)
    if args.serve:
        served = run_serve(args, sizes, work, sizes["model_70b"], 2)
    result = summarize(args, sizes, tp1, tp2, dp2, big, ar, big_int4, served, eager)
    big_key = f"tp{args.big_tp}_70b"
    for key, value in run_metadata(torch.device(args.device)).items():   # no engine child ran (serving alone)
        result.setdefault(key, value)
    result["bench_wall_s"] = time.perf_counter() - started
    result["command"] = " ".join(["python", "bench/tp_bench.py", *(sys.argv[1:] if argv is None else argv)])
    tag = args.tag or (f"{gpu_tag()}x{max(2, args.big_tp)}" if args.device == "cuda" else "cpu")
    path = args.out / f"tp_{tag}.json"
    ran = [part for part, run in (("8b", tp1 or tp2 or dp2), ("8b_eager", eager),
                                  ("70b" if args.big_tp == 2 else f"70b_tp{args.big_tp}", big),
                                  ("70b_int4", big_int4), ("serve_70b", served)) if run]
    result["parts"] = {part: {k: result[k] for k in ("commit", "date", "command")} for part in ran}
    if args.update and path.is_file():
        result = merged(json.loads(path.read_text()), result)
    write_json(path, result)
    plot(result, path.with_suffix(".png"))
    rows = [{"config": k, **{c: v for c, v in (result.get(k) or {}).items() if not isinstance(v, (list, dict))}}
            for k in ("tp1_8b", "tp2_8b", "dp2_8b", "tp2_eager_8b", big_key, "tp2_70b_int4") if result.get(k)]
    print_table(rows, "tensor / data parallel")
    print_table(result.get("allreduce", []), "all-reduce")
    print_table(result.get("allreduce_share", []), "all-reduce share of a decode step (microbenchmark x layers)")
    for key in ("tp2_8b_step_profile", f"{big_key}_step_profile"):
        if isinstance(result.get(key), list):
            print_table(result[key], f"{key}: all-reduce in the profiled steps (driver)")
    print(f"wrote {path} in {result['bench_wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
