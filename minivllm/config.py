"""Engine configuration with vLLM's option names; validated once, read everywhere."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str | None = None            # HF folder, .gguf file, or a dummy config name; None = default model
    tokenizer: str | None = None
    load_format: str = "auto"           # "auto" | "safetensors" | "gguf" | "dummy"
    dtype: str = "auto"                 # "auto" | "float32" | "bfloat16" | "float16"
    device: str | None = None           # None: cuda if available, else cpu
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes for the KV cache on CPU (or to override on GPU)
    num_gpu_blocks_override: int | None = None
    scheduling_policy: str = "fcfs"     # "fcfs" | "priority"
    max_num_waiting: int | None = None  # admission control: reject beyond this many waiting requests
    # While few sequences run (SchedulerConfig.small_batch_max_seqs), a step takes at most this many prompt
    # tokens: prompts that arrive together are prefilled one after another. None: off; `serve` uses 512.
    small_batch_prefill_tokens: int | None = None
    # Inter-token-latency target in ms: while decodes run, a step takes only the prompt tokens that its
    # measured cost allows within it (docs/serving.md, "ITL target"). None: off.
    max_itl_ms: float | None = None
    # Time every step on the device (start and end events) for `/metrics`' step histograms (engine/step_times.py);
    # always on with an ITL target, whose cost model times every step anyway.
    collect_step_times: bool = False
    # "recompute" | "swap" (None: recompute): swap copies a long preempted sequence's KV blocks to
    # `swap_space` GiB of (pinned) CPU memory and back instead of recomputing it (ARCHITECTURE.md, "Swap").
    preemption_mode: str | None = None
    swap_space: float = 4
    enforce_eager: bool = False
    # Steps with prompt tokens (prefill, chunks, prefix hits) of up to this many tokens also replay a
    # CUDA graph, padded to a captured size; longer ones run eagerly. 0: only decode steps use graphs.
    cuda_graph_max_tokens: int = 4096
    # Schedule step N+1 while step N runs on the GPU (throughput, ITL) at the cost of about one step of
    # TTFT for requests that arrive meanwhile. None: on for CUDA, off for CPU (where nothing overlaps).
    async_scheduling: bool | None = None
    attention_backend: str | None = None  # "torch" | "triton"; None picks by device
    skip_tokenizer_init: bool = False
    tensor_parallel_size: int = 1
    # Tensor parallelism: a step (or any driver <-> worker exchange) that a rank has not finished after this
    # many seconds fails the engine with an error naming the rank, instead of waiting for it.
    distributed_timeout_s: float = 60.0
    # vLLM's speculative_config dict (spec_decode/config.py): {"method": "ngram" | "draft_model", ...}
    speculative_config: dict | None = None
    # "fp8" | "int8" | "gptq" | "awq" | "compressed-tensors"; None: from config.json's quantization_config
    # "gguf" (a .gguf file): keep its Q4_0/Q4_1/Q8_0 linear weights quantized instead of dequantizing
    quantization: str | None = None
    # "auto" (the model's dtype) | "fp8" = "fp8_e4m3": KV stored as float8_e4m3fn with per-layer scales
    # (ARCHITECTURE.md, "FP8 KV cache"), halving the bytes per cached token.
    kv_cache_dtype: str = "auto"
    # Multi-LoRA (docs/lora.md): `max_loras` adapters share a step (device slots of rank up to `max_lora_rank`);
    # `max_cpu_loras` (None: max_loras) stay read and checked in host memory for a quick return to a slot.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.small_batch_prefill_tokens is not None and self.small_batch_prefill_tokens < 1:
            raise ValueError("small_batch_prefill_tokens must be at least 1")
        if self.max_itl_ms is not None and (self.max_itl_ms <= 0 or not self.enable_chunked_prefill):
            raise ValueError(f"max_itl_ms must be positive and needs chunked prefill, got {self.max_itl_ms}")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError("cuda_graph_max_tokens must be non-negative")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}")
        if self.preemption_mode == "swap" and self.tensor_parallel_size > 1:
            raise ValueError("preemption_mode='swap' does not support tensor_parallel_size > 1 yet")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")
        if self.enable_lora:
            self._check_lora()
        if self.speculative_config is not None:
            from minivllm.spec_decode.config import SpeculativeConfig
            spec = SpeculativeConfig.from_dict(self.speculative_config)  # validate early, with the reason
            if spec.uses_draft_model and self.tensor_parallel_size > 1:
                # The draft runs on the driver only; worker ranks would miss its collectives.
                raise ValueError("draft_model speculation does not support tensor_parallel_size > 1 yet; "
                                 "use the ngram method")

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.tensor_parallel_size > 1:
            raise ValueError("enable_lora does not support tensor_parallel_size > 1 yet")
        if self.speculative_config is not None:
            raise ValueError("enable_lora does not support speculative decoding yet")
