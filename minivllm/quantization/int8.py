"""INT8 W8A8: per-channel symmetric int8 weights, dynamic per-token int8 activations, int32 accumulation
(torch._int_mm on CUDA), for GPUs without FP8 and for the CPU path. `quantization="int8"` quantizes a
plain checkpoint while loading. Computation in w8a8.py.
"""
from __future__ import annotations

import torch

from minivllm.quantization.w8a8 import W8A8Config


class Int8Config(W8A8Config):
    name = "int8"
    weight_dtype = torch.int8
