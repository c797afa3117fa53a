"""A model's config.json as the engine reads it, without transformers' config classes.

`read_config(path)` returns a `ModelConfig`: attribute access over the file's values, falling back to the
defaults of the family's transformers config class, with that class's aliases (GPT-2's `n_embd` is also
`hidden_size`). The defaults and aliases are a table generated from transformers
(`python -m minivllm.models.hf_config --write`; a test regenerates it and compares, and another compares every
attribute the engine reads against transformers' own config object for every shipped config).

Why not `transformers.AutoConfig`: importing any config class of current transformers releases imports its type
validators, which import the activations, the kernel hub and through it torch.distributed.tensor, torch._dynamo
and sympy, and where torchvision is installed its image stack too: 5.7 s of a server's 16-second start on the GPU
image (`bench/cold_start.py`, phase `resolve_model`). The engine needs none of it: a config here is data.
Values that transformers derives when the file leaves them out (`head_dim`, `num_key_value_heads`, the RoPE
parameters, Gemma's layer types) are derived where the engine reads them, from the same rules.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULTS_FILE = Path(__file__).parent / "config_defaults.json"
# model_type of every family the registry serves (models/registry.py)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "qwen3_moe", "qwen2_moe", "mixtral", "phi3", "gemma",
               "gemma2", "gemma3_text")

_table: dict | None = None


def _defaults_table() -> dict:
    global _table
    if _table is None:
        _table = json.loads(DEFAULTS_FILE.read_text())
    return _table


class ModelConfig:
    """config.json's values as attributes; what the file leaves out comes from the family's defaults."""

    def __init__(self, values: dict[str, Any]):
        model_type = values.get("model_type")
        if model_type is None:
            raise ValueError("config has no 'model_type'; not an HF config.json")
        family = _defaults_table()["families"].get(model_type)
        if family is None:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {list(MODEL_TYPES)}")
        aliases = family["attribute_map"]
        merged = dict(family["defaults"])
        merged.update({aliases.get(k, k): v for k, v in values.items()})
        object.__setattr__(self, "_values", merged)
        object.__setattr__(self, "_aliases", aliases)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        name = object.__getattribute__(self, "_aliases").get(name, name)
        if name in values:
            return values[name]
        raise AttributeError(f"config has no {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[self._aliases.get(name, name)] = value

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"ModelConfig({self._values.get('model_type')!r}, {len(self._values)} values)"


def read_config(path: str | Path) -> ModelConfig:
    """A config.json file (or a folder holding one) -> ModelConfig."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    values = json.loads(path.read_text())
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"{path} has no 'model_type'; not an HF config.json")
    return ModelConfig(values)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def transformers_defaults() -> dict:
    """The table, from the installed transformers: per family the defaults of its config class's fields (the
    values before the class derives others from them) and its attribute aliases."""
    import dataclasses
    import inspect

    import transformers
    families = {}
    for model_type in MODEL_TYPES:
        cls = transformers.CONFIG_MAPPING[model_type]
        if dataclasses.is_dataclass(cls):
            defaults = {}
            for f in dataclasses.fields(cls):
                if f.default is not dataclasses.MISSING:
                    defaults[f.name] = f.default
                elif f.default_factory is not dataclasses.MISSING:
                    defaults[f.name] = f.default_factory()
        else:   # transformers 4.x: the keyword defaults of __init__
            defaults = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
                        if p.default is not inspect.Parameter.empty}
        defaults = {k: v for k, v in sorted(defaults.items()) if _jsonable(v) and not k.startswith("_")}
        families[model_type] = {"defaults": defaults, "attribute_map": dict(sorted(cls.attribute_map.items()))}
    return {"transformers": transformers.__version__, "families": families}


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python -m minivllm.models.hf_config --write   (regenerates " + str(DEFAULTS_FILE) + ")")
    DEFAULTS_FILE.write_text(json.dumps(transformers_defaults(), indent=1) + "\n")
    print(f"wrote {DEFAULTS_FILE}")
