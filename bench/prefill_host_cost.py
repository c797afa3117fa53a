"""Host (Python + launch) cost of one eager paged prefill attention call, per key source: on a
prompt small enough that the GPU keeps up, calls are issued back to back and the wall time per
call is the host's. Long prompts build two TMA tensor descriptors per call; this shows what that
adds next to the pointer paths (a CUDA graph replays the launch without any of it).

    python bench/prefill_host_cost.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout, uninstalled
from bench.attention_bench import contiguous_kv, paged_queries, step_kv  # noqa: E402
from minivllm.kernels.prefill_attention import PrefillConfig, paged_prefill_attention  # noqa: E402


def host_us(fn, calls: int = 2000) -> float:
    """Median over five rounds of the wall time per call of `calls` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - started) / calls * 1e6)
    return sorted(rounds)[2]


def main() -> None:
    query_len = 64
    inputs = paged_queries(1, query_len, query_len, 32, 8, 128)
    query, k_cache, v_cache, _, _, block_tables = inputs
    key, value = step_kv(*contiguous_kv(k_cache, v_cache, block_tables, query_len), query_len)
    print(f"device: {torch.cuda.get_device_name()}; 1 x {query_len} tokens, 32/8 heads, head_dim 128")
    for name, config in [("paged", PrefillConfig(256, 64, 16, 3, contiguous_kv=False)),
                         ("contiguous pointers", PrefillConfig(256, 64, 16, 3)),
                         ("TMA descriptors", PrefillConfig(256, 64, 16, 3, tma=True))]:
        us = host_us(lambda: paged_prefill_attention(*inputs, 128 ** -0.5, config=config,
                                                     key=key, value=value))
        print(f"{name:22} {us:7.1f} us per call")


if __name__ == "__main__":
    main()
