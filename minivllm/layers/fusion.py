"""Whether layers may swap their plain-PyTorch ops for the Triton fusions in `minivllm.kernels`.

Only tensors on CUDA take the Triton path; `MINIVLLM_DISABLE_FUSIONS=1` turns it off (read when a layer
is built) so benchmarks can measure what the fusions buy.
"""
from __future__ import annotations

import os


def fusions_enabled() -> bool:
    if os.environ.get("MINIVLLM_DISABLE_FUSIONS", "0") == "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
