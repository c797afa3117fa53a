"""Weights streamed into L2 ahead of the one-token GEMV that reads them, from a side stream of the decode
CUDA graph: the kernels in front of that GEMV (rotary, attention and its reduction; the router and routing)
move well under a megabyte, so HBM idles while they run. `ahead` forks the prefetch off the capturing stream
(it starts once the kernel launched last has finished); `join` brings the side stream back before the
capture ends. Outside a capture, or with more than one row, nothing happens."""
from __future__ import annotations

import os

import torch

from minivllm.kernels import l2_prefetch

_streams: dict = {}
_pending: set = set()


def setting() -> int:
    return int(os.environ.get("MINIVLLM_AB_L2_PREFETCH", "0"))


def ahead(weight: torch.Tensor | None, rows: int) -> None:
    if weight is None or rows != 1 or not setting() or not l2_prefetch.prefetchable(weight):
        return
    side = _streams.get(weight.device)
    if side is None:
        side = _streams[weight.device] = torch.cuda.Stream(weight.device)
    if not torch.cuda.is_current_stream_capturing():
        return
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        l2_prefetch.prefetch(weight)
    _pending.add(weight.device)


def join() -> None:
    while _pending:
        torch.cuda.current_stream().wait_stream(_streams[_pending.pop()])
