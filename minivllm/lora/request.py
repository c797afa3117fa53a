"""LoRARequest: which adapter a request runs with, under vLLM's names. Plain data: every layer may hold one."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` (>= 1) identifies the adapter everywhere below the engine: GPU slots, the CPU cache and
    prefix-cache hashes. Two requests with the same id must name the same adapter folder."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError("lora_path must not be empty")
