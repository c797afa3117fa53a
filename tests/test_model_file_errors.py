"""Broken model files get a clear error: a truncated or corrupt GGUF or safetensors file raises a ModelFileError
(a ValueError) naming the file and what is wrong, and the CLI prints that message instead of a traceback."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch

from minivllm.cli import main
from minivllm.models.loader import load_model, resolve_model
from minivllm.models.model_files import ModelFileError, open_gguf
from tests.conftest import make_tiny_hf_checkpoint


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))


def copy_prefix(source: str, target: Path, size: int, replace_start: bytes = b"") -> Path:
    """The first `size` bytes of `source` in `target`, their start overwritten by `replace_start`."""
    with open(source, "rb") as f:
        data = f.read(size)
    target.write_bytes(replace_start + data[len(replace_start):])
    return target


def test_truncated_gguf_names_the_file_and_the_tensor_cut(default_model_path, tmp_path):
    tensor = next(t for t in open_gguf(default_model_path).tensors if t.name == "blk.3.attn_q.weight")
    cut = tensor.data_offset + tensor.n_bytes // 2
    path = copy_prefix(default_model_path, tmp_path / "model.gguf", cut)
    with pytest.raises(ModelFileError) as error:
        resolve_model(str(path))
    message = str(error.value)
    assert str(path) in message and "'blk.3.attn_q.weight'" in message and "truncated" in message
    assert f"{tensor.n_bytes:,} bytes at offset {tensor.data_offset:,}" in message and f"ends at {cut:,}" in message
    assert isinstance(error.value, ValueError)


def test_gguf_cut_in_its_metadata(default_model_path, tmp_path):
    path = copy_prefix(default_model_path, tmp_path / "model.gguf", 1000)
    with pytest.raises(ModelFileError, match=r"model\.gguf: the GGUF metadata needs .* the file ends at 1,000"):
        resolve_model(str(path))


def test_gguf_with_a_bad_magic(default_model_path, tmp_path):
    path = copy_prefix(default_model_path, tmp_path / "model.gguf", 1 << 20, replace_start=b"GGML")
    with pytest.raises(ModelFileError, match=r"model\.gguf: not a GGUF file"):
        resolve_model(str(path))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFileError, match=r"empty\.gguf: not a GGUF file"):
        resolve_model(str(tmp_path / "empty.gguf"))


def test_cli_prints_the_message_not_a_traceback(default_model_path, tmp_path, capsys):
    path = copy_prefix(default_model_path, tmp_path / "model.gguf", 1 << 20)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hello", "--model", str(path), "--device", "cpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"minivllm: error: {path}: ") and "truncated" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_hf_checkpoint(folder, "llama3")
    return folder


def broken_copy(checkpoint: Path, folder: Path, change) -> Path:
    """A copy of the checkpoint folder whose model.safetensors bytes went through `change`."""
    shutil.copytree(checkpoint, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(change(weights.read_bytes()))
    return folder


def test_checkpoint_loads_unchanged(checkpoint):
    load_model(resolve_model(str(checkpoint)), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("change", [
    lambda data: data[:-1000],                                # the tensor data cut short
    lambda data: data[:100],                                  # cut inside the header
    lambda data: data[:8] + b"#" + data[9:],                  # the header's JSON corrupt
    lambda data: struct.pack("<Q", 1 << 40) + data[8:],       # the header's length corrupt
], ids=["truncated", "cut-in-header", "corrupt-header", "corrupt-length"])
def test_broken_safetensors_names_the_file(checkpoint, tmp_path, change):
    folder = broken_copy(checkpoint, tmp_path / "model", change)
    with pytest.raises(ModelFileError) as error:
        load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"))
    assert str(error.value).startswith(f"{folder / 'model.safetensors'}: not a readable safetensors file: ")
