"""Pick a kernel's tile configuration by timing the candidates once per problem shape, on the GPU.

The best tile and split-K for a quantized GEMM change with M, N and K, and the library GEMMs beat every
Triton tile at some shapes (large M), so each call site lists candidates (`None` meaning its library
path) and the first call of a shape times them all from a CUDA graph (device time: timed eagerly, small
kernels measure the host's launches) and keeps the fastest. A shape first seen while a CUDA graph is being
captured takes the default without timing and counts as deferred (`deferred_under_capture`): the graph runner
then runs that size eagerly, which times it, and captures it again.

Weights are timed cold: in a decode step every other layer's weights pass through L2 between two calls of
one layer, so the timed calls rotate through copies of the weights that together exceed L2. Timing one
copy over and over would measure L2 reads for any layer under 50 MB: on the H100 the int4 GEMV's o_proj takes
8.4 us that way and 10.4 us in the engine, down_proj 14.5 against 19.3.

Timed alone, back to back, a tile is not timed where it runs: in a decode step, behind other kernels, beside the
next one's early start. Choices measured in the whole step (bench/kernels/step_tile_search.py --write-configs)
ship per device in configs/<device name>.json, as vLLM ships its tuned kernel configs; a key found there takes the
stored candidate without timing (MINIVLLM_TUNED_CONFIGS=0 in envs.py: time every key). A stored choice that is
not among a key's candidates is ignored.
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import re
from pathlib import Path
from typing import Callable, Hashable, Sequence, TypeVar

import torch

from minivllm import envs

logger = logging.getLogger(__name__)
Config = TypeVar("Config")
_chosen: dict[Hashable, object] = {}
_deferred = 0
_NOT_STORED = object()
measured: dict[Hashable, list[tuple[float, object]]] = {}   # key -> (seconds, candidate) as timed (benchmarks report)


def note_deferred_under_capture() -> None:
    """Record that a kernel took a fallback because a CUDA graph was being captured (a choice not timed, a
    buffer not allocated): the graph works but is not the one an eager warm-up would have set up."""
    global _deferred
    _deferred += 1


def deferred_under_capture() -> int:
    """How many times `note_deferred_under_capture` was called in this process."""
    return _deferred


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


COLD_BYTES = 128 << 20   # the weight copies a timing rotates through: well over an H100's 50 MB of L2


def cold_copy_count(nbytes: int) -> int:
    """How many copies of `nbytes` of weights (the original among them, 16 at most) exceed COLD_BYTES together."""
    return max(1, min(16, -(-COLD_BYTES // max(nbytes, 1))))


def cold_copies(weights: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """`weights` and enough copies of them to exceed COLD_BYTES together (`cold_copy_count`); fewer if memory
    is short."""
    copies = [tuple(weights)]
    for _ in range(cold_copy_count(sum(t.numel() * t.element_size() for t in weights)) - 1 if weights else 0):
        try:
            copies.append(tuple(t.clone() for t in weights))
        except torch.cuda.OutOfMemoryError:
            break
    return copies


CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def config_file(device_name: str) -> Path:
    """The stored choices' file for a device: configs/NVIDIA_H100_80GB_HBM3.json for "NVIDIA H100 80GB HBM3"."""
    return CONFIG_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


@functools.cache
def _stored_choices(path: Path) -> dict[str, str]:
    return json.loads(path.read_text())["choices"] if path.is_file() else {}


def stored_choice(key: Hashable, candidates: Sequence[Config], device_name: str, missing=None):
    """The candidate stored for `key` on this device (matched by repr, as --write-configs writes both), or
    `missing` (a stored choice may itself be None: a library path)."""
    if not envs.MINIVLLM_TUNED_CONFIGS:
        return missing
    wanted = _stored_choices(config_file(device_name)).get(repr(key))
    return next((c for c in candidates if repr(c) == wanted), missing) if wanted is not None else missing


def chosen(key: Hashable):
    """The candidate `pick` chose for `key` in this process, or None: for callers whose candidate list costs
    something to build."""
    return _chosen.get(key)


def pick(key: Hashable, candidates: Sequence[Config], run: Callable[..., object], default: Config,
         weights: Sequence[torch.Tensor] = ()) -> Config:
    """The fastest of `candidates` for `key` (stored for this device, or timed on its first call), or `default`
    where timing can't run. `run(candidate, *weights)` computes with the given weight tensors; timed calls pass
    copies in turn."""
    if key in _chosen:
        return _chosen[key]
    if len(candidates) < 2 or not torch.cuda.is_available():
        return default
    stored = stored_choice(key, candidates, torch.cuda.get_device_name(), missing=_NOT_STORED)
    if stored is not _NOT_STORED:
        _chosen[key] = stored
        return stored
    if torch.cuda.is_current_stream_capturing():
        note_deferred_under_capture()
        return default
    copies = cold_copies(weights)
    turn = itertools.count()
    timings = []
    for candidate in candidates:
        try:
            seconds = device_seconds(lambda: run(candidate, *copies[next(turn) % len(copies)]),
                                     calls=max(5, len(copies)))
            timings.append((seconds, candidate))
        except Exception as e:   # a tile that does not fit this GPU (shared memory, registers): not a candidate
            logger.debug("tuning %s: %s failed: %s", key, candidate, e)
    del copies
    best = min(timings, key=lambda t: t[0])[1] if timings else default
    _chosen[key] = best
    measured[key] = timings
    logger.debug("tuning %s: chose %s", key, best)
    return best
