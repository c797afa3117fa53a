"""Every environment variable minivllm reads, with its default and meaning; docs/environment.md documents the
same list for users. Code reads them as attributes, `envs.MINIVLLM_CACHE`, and nowhere else: each access reads
the environment anew, so a value set after import (a test's monkeypatch, a benchmark between two CUDA graph
captures) applies from the next read on. A value a variable cannot take raises a ValueError naming it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


def _switch(name: str, default: bool) -> bool:
    """A 0/1 variable; unset or empty means `default`."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, not {value!r}")
    return value == "1"


environment_variables: dict[str, Callable[[], Any]] = {
    # Folder for GGUF files converted to safetensors (one `gguf-<sha256 prefix>` folder per file), so a second
    # start skips the conversion.
    "MINIVLLM_CACHE": lambda: Path(os.environ.get("MINIVLLM_CACHE") or Path.home() / ".cache" / "minivllm"),
    # The API key `minivllm serve` requires (`Authorization: Bearer KEY`) and `minivllm router` sends to its
    # backends, when --api-key is not given. Unset: no key.
    "MINIVLLM_API_KEY": lambda: os.environ.get("MINIVLLM_API_KEY") or None,
    # 1: layers keep their plain PyTorch ops instead of the fused Triton kernels (read when a layer is built), to
    # debug a fused path or measure what the fusions buy.
    "MINIVLLM_DISABLE_FUSIONS": lambda: _switch("MINIVLLM_DISABLE_FUSIONS", False),
    # 0: ordinary kernel launches instead of programmatic dependent launch on Hopper (kernels/pdl.py), to rule
    # PDL out when debugging. Read at each launch; a CUDA graph keeps the launches it captured.
    "MINIVLLM_PDL": lambda: _switch("MINIVLLM_PDL", True),
    # 0: ignore the tile choices shipped in kernels/configs/ and time every kernel shape on its first call.
    "MINIVLLM_TUNED_CONFIGS": lambda: _switch("MINIVLLM_TUNED_CONFIGS", True),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
