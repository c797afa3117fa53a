"""The parallel safetensors reader against safetensors' own reader: every dtype, tensors whose data starts at
an odd byte, empty tensors, several windows and chunks per shard, and a truncated file."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minivllm.models import safetensors_reader
from minivllm.models.model_files import ModelFileError
from minivllm.models.safetensors_reader import ParallelReader, iterate_shards, read_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {"odd.bytes": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=generator),
               "mask": torch.rand(5, generator=generator) > 0.5, "empty": torch.zeros(0, 4),
               "codes": torch.randint(-2**31, 2**31 - 1, (33, 3), dtype=torch.int32, generator=generator),
               "fp8": torch.randn(9, 4, generator=generator).to(torch.float8_e4m3fn)}
    for i, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32, torch.float64)):
        tensors[f"layer.{i}.weight"] = torch.randn(41 + i, 13, generator=generator).to(dtype)
    return tensors


def _reference(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("window_bytes, chunk_bytes", [(1 << 30, 32 << 20), (300, 64), (1, 7)])
def test_every_tensor_equals_safetensors_own_reading(tmp_path, monkeypatch, window_bytes, chunk_bytes):
    """Byte for byte, whatever the windows (one per shard, a few tensors each, one tensor each) and chunks."""
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path))
    monkeypatch.setattr(safetensors_reader, "WINDOW_BYTES", window_bytes)
    reader = ParallelReader(torch.device("cpu"), threads=3, chunk_bytes=chunk_bytes)
    try:
        read = dict(read_safetensors(path, reader))
    finally:
        reader.close()
    expected = _reference(path)
    assert read.keys() == expected.keys()
    for name, tensor in expected.items():
        got = read[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_tensor_whose_data_starts_at_an_odd_byte(tmp_path):
    """safetensors' writer orders tensors so that each starts aligned; another writer may not."""
    floats = torch.arange(3, dtype=torch.float32)
    header = json.dumps({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "b": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes([1, 2, 3]) + floats.numpy().tobytes())
    read = dict(iterate_shards([path], torch.device("cpu")))
    assert torch.equal(read["b"], floats) and read["a"].tolist() == [1, 2, 3]


def test_shards_in_turn_and_a_truncated_one_is_named(tmp_path):
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x": torch.arange(10.0)}, str(first))
    save_file({"y": torch.arange(6).view(2, 3)}, str(second))
    read = dict(iterate_shards([first, second], torch.device("cpu")))
    assert torch.equal(read["x"], torch.arange(10.0)) and torch.equal(read["y"], torch.arange(6).view(2, 3))
    data = second.read_bytes()
    second.write_bytes(data[:-8])
    with pytest.raises(ModelFileError, match="b.safetensors"):
        dict(iterate_shards([first, second], torch.device("cpu")))


@pytest.mark.gpu
def test_tensors_land_on_the_gpu_equal(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path))
    monkeypatch.setattr(safetensors_reader, "WINDOW_BYTES", 300)
    reader = ParallelReader(torch.device("cuda"), chunk_bytes=64)
    try:
        read = dict(read_safetensors(path, reader))
    finally:
        reader.close()
    for name, tensor in _reference(path).items():
        assert read[name].is_cuda and torch.equal(read[name].cpu().view(torch.uint8), tensor.view(torch.uint8)), name
