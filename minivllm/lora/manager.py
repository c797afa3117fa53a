"""LoRAManager: the runner's side of multi-LoRA, owning which adapters are known, which sit in the host
cache and which occupy the `max_loras` device slots.

Slots are handed out least recently used first; an adapter evicted from its slot stays in the host cache
(`max_cpu_loras`, also LRU) and comes back with one copy per layer, from pinned memory on CUDA, queued on the
stream behind the step in flight, so the host does not wait. An adapter evicted from the host cache is read
from its folder again. The scheduler guarantees that a step holds at most `max_loras` distinct adapters;
this class must not decide what runs.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from minivllm.core.interfaces import SchedulerOutput
from minivllm.lora.layers import LoRABatch, wrap_linear_layers
from minivllm.lora.peft import LoRAModel, load_peft_adapter
from minivllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 max_num_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch(max_num_tokens, max_loras, device)
        self.methods = wrap_linear_layers(model, self.batch, max_lora_rank, dtype, device)
        if not self.methods:
            raise ValueError(f"{type(model).__name__} has no q/k/v/o/gate/up/down projections to apply LoRA to")
        self.packed_modules_mapping = getattr(model, "packed_modules_mapping", {})
        self.adapters: dict[int, LoRARequest] = {}                 # known (added and not removed)
        self.cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()         # lora_int_id -> slot, LRU first
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.num_slot_loads = 0   # adapters copied into a slot (first use or after eviction)
        self.num_disk_loads = 0
        self.slot_bytes = sum(m.lora_a[0].nbytes + m.lora_b[0].nbytes for m in self.methods.values())
        logger.info("LoRA: %d slots of rank %d on %d layers (%.1f MiB each)", max_loras, max_lora_rank,
                    len(self.methods), self.slot_bytes / 2**20)

    # ---- adapters known to the engine --------------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> bool:
        """Read and check an adapter into the host cache; False when it is known already. ValueError when the
        folder is bad or the id or name belongs to another adapter."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is already used by adapter "
                                 f"{known.lora_name!r} ({known.lora_path})")
            return False
        if any(a.lora_name == request.lora_name for a in self.adapters.values()):
            raise ValueError(f"an adapter named {request.lora_name!r} is loaded already")
        self._cache(self._read(request))
        self.adapters[request.lora_int_id] = request
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter and free its slot (a step in flight still reads it: the next slot copy is queued
        behind). Requests admitted with it read it from its folder again."""
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        self.cpu_cache.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return True

    def list_adapters(self) -> list[LoRARequest]:
        return list(self.adapters.values())

    def _read(self, request: LoRARequest) -> LoRAModel:
        self.num_disk_loads += 1
        return load_peft_adapter(request.lora_int_id, request.lora_path, self.methods, self.packed_modules_mapping,
                                 self.max_lora_rank, self.dtype, pin_memory=self.device.type == "cuda")

    def _cache(self, adapter: LoRAModel) -> None:
        self.cpu_cache[adapter.lora_int_id] = adapter
        self.cpu_cache.move_to_end(adapter.lora_int_id)
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)

    # ---- one step ------------------------------------------------------------------------------------------------
    def set_step(self, scheduler_output: SchedulerOutput) -> None:
        """Bring the step's adapters into slots and map each of its rows to its slot (-1: the base model)."""
        requests = {}
        for seq in scheduler_output.seqs:
            request = seq.group.lora_request
            if request is not None:
                requests[request.lora_int_id] = request
        assert len(requests) <= self.max_loras, "the scheduler admitted more adapters than there are slots"
        slot_of_seq = [-1] * len(scheduler_output.seqs)
        for i, seq in enumerate(scheduler_output.seqs):
            request = seq.group.lora_request
            if request is not None:
                slot_of_seq[i] = self._slot(request, requests)
        token_slots = np.repeat(np.asarray(slot_of_seq, dtype=np.int64), scheduler_output.num_scheduled_tokens)
        self.batch.set_mapping(token_slots)

    def _slot(self, request: LoRARequest, in_step: dict[int, LoRARequest]) -> int:
        lora_id = request.lora_int_id
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        if self.free_slots:
            slot = self.free_slots.pop()
        else:   # the least recently used adapter that this step does not need
            victim = next(i for i in self.slot_of if i not in in_step)
            slot = self.slot_of.pop(victim)
        adapter = self.cpu_cache.get(lora_id)
        if adapter is None:
            adapter = self._read(self.adapters.get(lora_id, request))
            if lora_id in self.adapters:
                self._cache(adapter)
        else:
            self.cpu_cache.move_to_end(lora_id)
        for name, method in self.methods.items():
            method.load_slot(slot, adapter.weights.get(name))
        self.slot_of[lora_id] = slot
        self.num_slot_loads += 1
        return slot
