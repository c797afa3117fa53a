"""Opening checkpoint files: GGUF through gguf's `GGUFReader`, safetensors through safetensors' `safe_open`.

A truncated download or a file of another kind would otherwise fail deep inside numpy (`cannot reshape array of
size ...`) or the Rust reader, naming neither the file nor the cause. Here every such file raises a
`ModelFileError` that names the file and what is wrong with it: a GGUF file's magic, a read past its end (which
tensor, how many bytes at which offset, and where the file ends), or the safetensors reader's own diagnosis of
its header. GGUF files that open are read by gguf as they are; safetensors files by models/safetensors_reader.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from safetensors import SafetensorError, safe_open

GGUF_MAGIC = b"GGUF"


class ModelFileError(ValueError):
    """A model file that cannot be read: truncated, corrupt, or not in the format it claims."""


class _CheckedGGUFReader(GGUFReader):
    """GGUFReader that checks each read against the end of the file before numpy slices the memory map (a slice
    past the end is silently short, and fails later in a reshape or an index)."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > self.data.size:
            raise ModelFileError(f"{self.path}: the GGUF metadata needs {end:,} bytes but the file ends at "
                                 f"{self.data.size:,} (truncated?)")
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        # The tensor-info fields' parts: name length, name, number of dims, dims, type, offset in the data.
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            except (ValueError, KeyError):
                raise ModelFileError(f"{self.path}: tensor {name!r} has unknown type {int(raw_type[0])} "
                                     "(corrupt, or newer than the gguf package)") from None
            nbytes = int(np.prod(dims)) * type_size // block_size
            begin = int(start_offs + offset[0])
            if begin + nbytes > self.data.size:
                raise ModelFileError(f"{self.path}: tensor {name!r} needs {nbytes:,} bytes at offset {begin:,} but "
                                     f"the file ends at {self.data.size:,} (truncated?)")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | Path) -> GGUFReader:
    """A GGUFReader of `path`, every tensor's bytes within the file."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        return _CheckedGGUFReader(path)
    except ModelFileError:
        raise
    except (ValueError, KeyError) as error:   # the reader's own checks: version, alignment, duplicate names
        raise ModelFileError(f"{path}: not a readable GGUF file: {error}") from error


def open_safetensors(path: str | Path):
    """safe_open of `path` on the CPU (a context manager yielding the file's tensors); the reader checks the
    header and that the tensors' data lies within the file."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as error:
        raise ModelFileError(f"{path}: not a readable safetensors file: {error} (truncated or corrupt?)") from error
