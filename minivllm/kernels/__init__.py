"""Triton kernels, each next to its plain-PyTorch reference.

Importing this package imports Triton, so only code that has already chosen the Triton path (the
Triton attention backend, GPU layers) may import it; the CPU path never does. On a machine without a
GPU the kernels still run under the Triton interpreter (TRITON_INTERPRET=1), which is how the tests
check them against their references.
"""
import os


def _patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a runtime scalar into a loop bound with `int(array_of_shape_1)`,
    which NumPy >= 2.4 rejects (triton-lang/triton#9171, fixed upstream after 3.6). Our kernels loop
    to data-dependent bounds, so under the interpreter only, convert through `.item()` instead."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.ones(1))
        return  # this NumPy still converts one-element arrays
    except TypeError:
        pass
    original = interpreter._patch_lang_tensor
    if getattr(original, "minivllm_patched", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.minivllm_patched = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_scalar_index()

# The kernel modules come after the interpreter fix so that it is in place before any launch.
from minivllm.kernels.activation import silu_and_mul, silu_and_mul_reference  # noqa: E402
from minivllm.kernels.decode_attention import (  # noqa: E402
    choose_decode_splits, paged_decode_attention)
from minivllm.kernels.fused_moe import fused_experts, fused_experts_reference  # noqa: E402
from minivllm.kernels.kv_write import write_kv  # noqa: E402
from minivllm.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from minivllm.kernels.rmsnorm import (  # noqa: E402
    fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm, rms_norm_reference)

__all__ = [
    "choose_decode_splits", "fused_add_rms_norm", "fused_add_rms_norm_reference", "fused_experts",
    "fused_experts_reference",
    "paged_decode_attention", "paged_prefill_attention", "rms_norm", "rms_norm_reference",
    "silu_and_mul", "silu_and_mul_reference", "write_kv",
]
