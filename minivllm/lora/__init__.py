"""Multi-LoRA serving: adapters on one base model, mixed with it in one batch (docs/lora.md).

- `request.py`: LoRARequest, the face a request carries (plain data);
- `peft.py`: reading a PEFT adapter folder into slot-shaped CPU tensors, with its checks;
- `layers.py`: the linear-layer seam (a quant method that adds the adapter's delta) and the step's
  row-to-slot mapping the kernels read;
- `manager.py`: the runner's side, GPU slots with LRU eviction and the CPU cache.
"""
from minivllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
