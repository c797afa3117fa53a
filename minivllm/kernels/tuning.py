"""Pick a kernel's tile configuration by timing the candidates once per problem shape, on the GPU.

The best tile and split-K for a quantized GEMM change with M, N and K, and the library GEMMs beat every
Triton tile at some shapes (large M), so each call site lists candidates (`None` meaning its library
path) and the first call of a shape times them all from a CUDA graph (device time: timed eagerly, small
kernels measure the host's launches) and keeps the fastest. The engine's warm-up passes run each decode
batch size before its graph is captured, so capture finds the choice made; a shape first seen while a
graph is being captured takes the default without timing.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable, Sequence, TypeVar

import torch

logger = logging.getLogger(__name__)
Config = TypeVar("Config")
_chosen: dict[Hashable, object] = {}


def device_seconds(fn: Callable[[], object], calls: int = 5, repeats: int = 5) -> float:
    """Median seconds per call of `fn`, `calls` of them captured in one CUDA graph and replayed `repeats` times."""
    fn()   # compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)   # elapsed_time is in milliseconds
    del graph
    return sorted(times)[len(times) // 2]


def pick(key: Hashable, candidates: Sequence[Config], run: Callable[[Config], object], default: Config) -> Config:
    """The fastest of `candidates` for `key` (timed on its first call), or `default` where timing can't run."""
    if key in _chosen:
        return _chosen[key]
    if len(candidates) < 2 or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return default
    timings = []
    for candidate in candidates:
        try:
            timings.append((device_seconds(lambda: run(candidate)), candidate))
        except Exception as e:   # a tile that does not fit this GPU (shared memory, registers): not a candidate
            logger.debug("tuning %s: %s failed: %s", key, candidate, e)
    best = min(timings, key=lambda t: t[0])[1] if timings else default
    _chosen[key] = best
    logger.debug("tuning %s: chose %s", key, best)
    return best
