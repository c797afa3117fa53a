"""What the engine reports about itself: what it is (EngineInfo, fixed once built) and its counters between steps
(EngineStats). Plain dataclasses with no torch behind them, so the server's process (engine/engine_process.py)
reads them without importing the engine stack."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.step_times import StepTimes
from minivllm.spec_decode.stats import SpecDecodeStats


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    spec_decode: SpecDecodeStats | None = None
    num_swapped: int = 0    # requests whose KV is swapped out to CPU now
    num_swap_outs: int = 0  # preemptions that swapped (the rest recomputed)
    # Multi-LoRA: adapter names of running and waiting requests, and the slots (None: LoRA off).
    running_lora_adapters: list[str] | None = None
    waiting_lora_adapters: list[str] | None = None
    max_lora: int | None = None
    step_times: StepTimes | None = None   # the engine's live step histograms (read, never changed, by /metrics)


@dataclass
class EngineInfo:
    """What the server reads about the engine, fixed once it is built."""
    model_name: str
    max_model_len: int
    quantization: str | None = None
    vocab_size: int | None = None
    config: Any = None
    startup_seconds: dict = field(default_factory=dict)

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:
        return cls(engine.model_name, engine.max_model_len, getattr(engine, "quantization", None),
                   getattr(engine, "vocab_size", None), getattr(engine, "config", None),
                   dict(getattr(engine, "startup_seconds", {})))
