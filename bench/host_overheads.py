"""Host-side costs that decide how well the CPU keeps up with the GPU, measured on the device:

1. whether allocating fresh pinned host memory waits for the GPU (it does when it blocks while a
   long kernel queue runs);
2. host time per call of each Triton kernel wrapper against a plain torch op, on tiny shapes (the GPU
   finishes each kernel before the next launch, so the host's own cost is what is timed);
3. a cProfile of one eager prefill step of the engine (default: dummy Llama-3-8B, one 512-token prompt).

  python bench/host_overheads.py [--model llama-3-8b] [--prompt-len 512]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def busy_gpu(ms: float) -> None:
    """Queue roughly `ms` milliseconds of matmuls without waiting for them."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ a
    end.record()
    end.synchronize()
    for _ in range(max(1, int(ms / max(start.elapsed_time(end), 1e-3)))):
        a @ a


def pinned_allocation() -> None:
    print("--- pinned host allocation while ~200 ms of GPU work is queued")
    for label, make in (("torch.empty(pin_memory=True), new size", lambda n: torch.empty(n, pin_memory=True)),
                        ("tensor.pin_memory(), new size", lambda n: torch.empty(n).pin_memory()),
                        ("torch.empty(), pageable", lambda n: torch.empty(n))):
        for size in (1000 + 17 * len(label), 3_000_000 + 17 * len(label)):
            busy_gpu(200)
            started = time.perf_counter()
            make(size)
            host_ms = 1e3 * (time.perf_counter() - started)
            torch.cuda.synchronize()
            print(f"  {label:42s} {size:>9d} floats: {host_ms:8.3f} ms on the host")


def launch_costs() -> None:
    from minivllm.kernels import paged_decode_attention, paged_prefill_attention, write_kv
    from minivllm.kernels.activation import silu_and_mul
    from minivllm.kernels.rmsnorm import fused_add_rms_norm
    from minivllm.kernels.rotary import apply_rotary_
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(4, 4096, device=dev, dtype=dt)
    w = torch.ones(4096, device=dev, dtype=dt)
    qkv = torch.randn(4, 6144, device=dev, dtype=dt)
    q, k, v = (t.view(4, -1, 128) for t in qkv.split([4096, 1024, 1024], dim=-1))
    positions = torch.arange(4, device=dev)
    cos_sin = torch.randn(64, 128, device=dev)
    caches = torch.zeros(2, 64, 16, 8, 128, device=dev, dtype=dt)
    slots = torch.arange(4, device=dev)
    block_tables = torch.arange(4, device=dev, dtype=torch.int32).view(4, 1)
    seq_lens = torch.full((4,), 1, device=dev, dtype=torch.int32)
    qsl = torch.arange(5, device=dev, dtype=torch.int32)
    gate_up = torch.randn(4, 2 * 14336, device=dev, dtype=dt)
    calls = {
        "torch.add (reference point)": lambda: torch.add(x, x),
        "fused_add_rms_norm": lambda: fused_add_rms_norm(x, x, w, 1e-5),
        "apply_rotary_": lambda: apply_rotary_(positions, q, k, cos_sin),
        "write_kv": lambda: write_kv(k, v, caches[0], caches[1], slots),
        "silu_and_mul": lambda: silu_and_mul(gate_up),
        "paged_prefill_attention": lambda: paged_prefill_attention(q.contiguous(), caches[0], caches[1], qsl, seq_lens,
                                                                   block_tables, 0.1, max_query_len=1),
        "paged_decode_attention": lambda: paged_decode_attention(q.contiguous(), caches[0], caches[1], block_tables,
                                                                 seq_lens, 0.1),
    }
    print("--- host time per call (us), 500 calls each")
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(500):
            fn()
        per_call = 1e6 * (time.perf_counter() - started) / 500
        torch.cuda.synchronize()
        print(f"  {name:32s} {per_call:8.1f}")


def prefill_profile(model: str, prompt_len: int) -> None:
    from minivllm import LLM, SamplingParams
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=8,
              max_model_len=prompt_len + 64)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for round_ in range(3):
        engine.add_request(f"r{round_}", torch.randint(0, 1000, (prompt_len + 2 * round_,)).tolist(), params)
        profiler = cProfile.Profile() if round_ == 2 else None
        torch.cuda.synchronize()
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        engine.step()
        if profiler:
            profiler.disable()
        torch.cuda.synchronize()
        print(f"--- prefill step {round_}: {1e3 * (time.perf_counter() - started):.1f} ms wall"
              + (" (cProfile on)" if profiler else ""))
        while engine.has_unfinished_requests():
            engine.step()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    pinned_allocation()
    launch_costs()
    prefill_profile(args.model, args.prompt_len)


if __name__ == "__main__":
    main()
