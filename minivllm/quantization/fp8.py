"""FP8 (e4m3) W8A8, vLLM's `fp8`: per-channel weight scales, dynamic per-token activation scales.

Two sources: `quantization="fp8"` on a plain checkpoint quantizes each weight while loading; a checkpoint
whose config.json has `quant_method: "fp8"` stores `weight` in float8_e4m3fn with `weight_scale` (per
tensor or per channel) and, for static activation schemes, an `input_scale` (ignored: scales are
per token here). Computation in w8a8.py (torch._scaled_mm on Hopper).
"""
from __future__ import annotations

from minivllm.quantization.w8a8 import FP8, W8A8Config


class Fp8Config(W8A8Config):
    name = "fp8"
    weight_dtype = FP8

    @classmethod
    def from_config(cls, config: dict) -> "Fp8Config":
        self = super().from_config(config)
        self.static_input_scale = config.get("activation_scheme", "dynamic") == "static"
        if config.get("weight_block_size"):
            raise ValueError("block-wise fp8 weight scales (weight_block_size) are not supported")
        return self
