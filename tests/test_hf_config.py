"""Configs read without transformers (models/hf_config.py) against transformers' own config objects: the shipped
defaults table equals what the installed transformers gives, and for every shipped config, the default model's
converted config and a checkpoint written by transformers, every attribute the engine reads has the value
transformers gives it (or, where transformers derives it at load, the same derived value where the engine
derives it)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers

from minivllm.layers.rotary import rope_parameters_of
from minivllm.models import hf_config, loader
from minivllm.models.gemma2 import layer_types_of
from minivllm.models.gemma3 import local_rope_parameters
from minivllm.models.llama import _head_dim

SOURCE = Path(hf_config.__file__).parent.parent
MISSING = object()


def engine_reads() -> set[str]:
    """Every config attribute named in minivllm's source (hf_config.X, hf.X, getattr(hf_config, "X", ...))."""
    names = set()
    for path in SOURCE.rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"\bhf(?:_config)?\.([a-z_][a-z0-9_]*)\b(?!\()", text))
        names |= set(re.findall(r"getattr\(hf(?:_config)?, \"([a-z_0-9]+)\"", text))
    return names


def _rope(params: tuple[float, dict]) -> tuple[float, dict]:
    """(theta, scaling) with the type spelled out: no type and "default" are the same rotation (layers/rotary)."""
    theta, scaling = params
    scaling = dict(scaling)
    scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type", "default"))
    if scaling.get("partial_rotary_factor") == 1.0:   # transformers 5 files Phi-3's full rotation here too
        del scaling["partial_rotary_factor"]
    return theta, scaling


# Values transformers derives while loading (or normalises into another attribute), compared as the engine
# derives them.
DERIVED = {
    "head_dim": _head_dim,
    "num_key_value_heads": lambda c: getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
    "rope_parameters": lambda c: (_rope(rope_parameters_of(c)), _rope(local_rope_parameters(c))),
    "rope_theta": lambda c: _rope(rope_parameters_of(c)),
    "rope_scaling": lambda c: _rope(rope_parameters_of(c)),
    "rope_local_base_freq": lambda c: _rope(local_rope_parameters(c)),
    # only Gemma-2/3 read it (transformers 5 also fills it in for Qwen2, where it means nothing to the engine)
    "layer_types": lambda c: layer_types_of(c, 6 if c.model_type == "gemma3_text" else 2)
    if c.model_type.startswith("gemma") else None,
    "sliding_window": lambda c: getattr(c, "sliding_window", None) if getattr(
        c, "use_sliding_window", c.model_type != "qwen2") else None,
}


def config_files(converted_default: Path) -> list[Path]:
    return sorted(loader.CONFIGS_DIR.glob("*.json")) + [converted_default]


@pytest.fixture(scope="module")
def converted_default(default_model_path) -> Path:
    from minivllm.models.gguf_loader import convert_gguf
    return Path(convert_gguf(default_model_path)) / "config.json"   # the conversion cache other tests share


def test_defaults_table_is_what_transformers_gives():
    shipped = json.loads(hf_config.DEFAULTS_FILE.read_text())
    assert shipped["families"] == hf_config.transformers_defaults()["families"], \
        "regenerate with: python -m minivllm.models.hf_config --write"


def _assert_engine_view_matches(path: Path):
    values = json.loads(path.read_text())
    ours = hf_config.read_config(path)
    theirs = transformers.AutoConfig.for_model(**values)
    reads = engine_reads()
    assert {"hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "tie_word_embeddings"} <= reads
    for name in sorted(reads - {"to_dict"}):
        if name in DERIVED:
            assert DERIVED[name](ours) == DERIVED[name](theirs), (path.name, name)
        else:
            assert getattr(ours, name, MISSING) == getattr(theirs, name, MISSING), (path.name, name)


def test_every_shipped_and_converted_config_reads_as_transformers_reads_it(converted_default):
    for path in config_files(converted_default):
        _assert_engine_view_matches(path)


def test_checkpoint_written_by_transformers_reads_the_same(tmp_path):
    """A config.json as save_pretrained writes it (only what differs from PretrainedConfig's defaults)."""
    for model_type, extra in (("qwen2", {"use_sliding_window": False, "sliding_window": 4096}),
                              ("gpt2", {"n_embd": 96, "n_head": 4}), ("gemma2", {}), ("mixtral", {}),
                              ("qwen2_moe", {"shared_expert_intermediate_size": 64}), ("phi3", {})):
        transformers.AutoConfig.for_model(model_type, **extra).save_pretrained(tmp_path / model_type)
        _assert_engine_view_matches(tmp_path / model_type / "config.json")


def test_aliases_defaults_and_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    config = hf_config.read_config(tmp_path)
    assert config.hidden_size == config.n_embd == 64 and config.num_hidden_layers == 2
    assert config.layer_norm_epsilon == transformers.GPT2Config().layer_norm_epsilon   # not in the file
    assert getattr(config, "no_such_value", None) is None
    path.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        hf_config.read_config(path)
    path.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="no 'model_type'"):
        hf_config.read_config(path)
