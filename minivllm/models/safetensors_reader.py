"""Reading safetensors shards at the disk's speed, straight into device memory.

safetensors' `safe_open` maps a shard and each tensor's copy faults its pages in one after another on one
thread: 1.5 GB/s for the 8B shapes on an H200 host (bench/results/safetensors_load_h200.json, at 8ec4392).
Here `safe_open` still checks a shard's header (names, dtypes, offsets within the file), and the data is
read with `os.preadv` by `READ_THREADS` threads in `CHUNK_BYTES` pieces, each into its thread's pinned
buffer and on to the device on its thread's stream, a window of whole tensors (`WINDOW_BYTES`, or one
larger tensor) at a time; the tensors handed out are views of the window's device copy, so the model's
weight loaders copy device to device. A dtype this reader does not know is read by `safe_open` instead.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from minivllm.models.model_files import ModelFileError, open_safetensors

READ_THREADS = 8
CHUNK_BYTES = 32 << 20
WINDOW_BYTES = 1 << 30
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_header(path: Path) -> tuple[dict, int]:
    """The shard's tensor entries {name: {dtype, shape, data_offsets}} and where its data begins."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def windows(entries: list[tuple[int, int, str]], limit: int) -> Iterator[list[tuple[int, int, str]]]:
    """`entries` (begin, end, name), sorted by offset, in runs spanning at most `limit` bytes (a larger
    tensor alone)."""
    run: list[tuple[int, int, str]] = []
    for entry in entries:
        if run and entry[1] - run[0][0] > limit:
            yield run
            run = []
        run.append(entry)
    if run:
        yield run


class ParallelReader:
    """Byte ranges of files read by a pool of threads into fresh device (or host) buffers."""

    def __init__(self, device: torch.device, threads: int = READ_THREADS, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.device, self.chunk_bytes = device, chunk_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="safetensors-read")
        self._local = threading.local()

    def close(self) -> None:
        self._pool.shutdown()

    def read(self, path: Path, offset: int, length: int) -> torch.Tensor:
        """Bytes [offset, offset + length) of `path` as a uint8 tensor on the device."""
        target = torch.empty(length, dtype=torch.uint8, device=self.device)
        fd = os.open(path, os.O_RDONLY)
        try:
            futures = [self._pool.submit(self._read_part, path, fd, offset, target, start,
                                         min(self.chunk_bytes, length - start))
                       for start in range(0, length, self.chunk_bytes)]
            wait(futures)   # every read has stopped before the descriptor closes, even after a failure
            for future in futures:
                future.result()
        finally:
            os.close(fd)
        return target

    def _read_part(self, path: Path, fd: int, offset: int, target: torch.Tensor, start: int, size: int) -> None:
        if self.device.type != "cuda":
            _pread_into(path, fd, target[start:start + size].numpy(), offset + start)
            return
        local = self._local
        if getattr(local, "staging", None) is None:   # each thread's own pinned buffer and stream
            local.staging = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
            local.stream = torch.cuda.Stream(self.device)
        staging = local.staging[:size]
        _pread_into(path, fd, staging.numpy(), offset + start)
        with torch.cuda.stream(local.stream):
            target[start:start + size].copy_(staging, non_blocking=True)
        local.stream.synchronize()   # the staging buffer is refilled next


def _pread_into(path: Path, fd: int, array, offset: int) -> None:
    view, done = memoryview(array), 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise ModelFileError(f"{path}: ends at byte {offset + done}, inside its tensors' data (truncated?)")
        done += count


def _as_tensor(raw: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=raw.device)
    if raw.storage_offset() % dtype.itemsize:   # after an odd-sized tensor: a view needs an aligned start
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def read_safetensors(path: Path, reader: ParallelReader) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on the reader's device) for every tensor of the shard, in the order of their data."""
    with open_safetensors(path) as checked:   # the library's checks of the header, once
        header, data_start = read_header(path)
        unknown = [name for name, info in header.items() if info["dtype"] not in DTYPES]
        for name in unknown:
            yield name, checked.get_tensor(name).to(reader.device)
    entries = sorted((info["data_offsets"][0], info["data_offsets"][1], name) for name, info in header.items()
                     if name not in unknown)
    for run in windows(entries, WINDOW_BYTES):
        begin = run[0][0]
        data = reader.read(path, data_start + begin, run[-1][1] - begin)
        for start, end, name in run:
            info = header[name]
            yield name, _as_tensor(data[start - begin:end - begin], DTYPES[info["dtype"]], info["shape"])
        del data


def iterate_shards(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the shards, read in parallel onto `device`."""
    reader = ParallelReader(device)
    try:
        for file in files:
            yield from read_safetensors(file, reader)
    finally:
        reader.close()
