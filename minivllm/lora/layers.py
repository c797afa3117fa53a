"""The LoRA seam in the linear layers, and the step's row-to-slot mapping the kernels read.

`LoRALinearMethod` takes the place of a linear layer's quant method: the base method computes y (dense,
int4 or fp8 weights alike), then each row gets its adapter's delta. The model's code is unchanged. The
wrapper offers none of the base method's fused epilogues (rotary, SiLU-and-mul, norms in the GEMV, input
quantization): each would hand the next layer an output without the delta, so with LoRA those layers run
their own kernels.

For a dense layer without bias, the shrink rides on the base GEMM: every slot's A, transposed, is stacked under
the weight, so `x · [W; A_0ᵀ; ...]` yields y and each slot's x · A in one GEMM and only the expand is left
(one kernel less per layer and step; the GEMM reads the extra rows of every slot, so only while they are few:
STACK_MAX_BYTES). Otherwise (quantized weights, a bias, many wide slots) a separate shrink kernel runs.

`LoRABatch` holds which slot each row of the step uses, as kernels/lora.py's block tables, in static device
buffers: a CUDA graph captured once reads each replay's mapping from them, so adapter indices are graph inputs
like token ids. It must not decide which adapter sits in which slot (manager.py does).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.lora import (BLOCK_MS, DECODE_ROWS, block_m_for, block_table, lora_expand,
                                   lora_expand_reference, lora_shrink, lora_shrink_reference, max_blocks, sort_rows)
from minivllm.layers.linear import LinearBase, PackedColumnLinear, UnquantizedLinearMethod

# Stack a layer's A columns under its dense weight while all slots' add at most this much to it: the GEMM then
# reads them at every step, in place of a shrink kernel. At one row on an H200 a Llama-3-8B layer's LoRA added
# 29.7 us with its four shrinks and 14.2 us without (bench/results/lora_kernels_h200.json): about 3.9 us a
# shrink, in which the same run's 4.2 TB/s reads some 16 MB.
STACK_MAX_BYTES = 8 << 20

# The model's packed linear layers LoRA applies to, each with the checkpoint projections it packs in order.
LORA_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRABatch:
    """Rows of the step that use an adapter, grouped by slot, and each row-block size's block table over them
    (kernels/lora.py). On the CPU the references read `token_slots` instead."""

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.use_triton = device.type == "cuda"
        self.sorted_token_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        # Row blocks of 16 serve steps of up to DECODE_ROWS rows (kernels/lora.block_m_for), of 64 the rest. Every
        # block is unused (slot -1) until the first mapping: what graph capture sees.
        rows_served = {BLOCK_MS[0]: min(max_num_tokens, DECODE_ROWS), BLOCK_MS[1]: max_num_tokens}
        self.tables = {bm: torch.full((3, max_blocks(rows, max_loras, bm)), -1, dtype=torch.int32, device=device)
                       for bm, rows in rows_served.items()}
        self.token_slots: torch.Tensor | None = None   # [T] on the host; None: no row uses an adapter

    def set_mapping(self, token_slots: np.ndarray) -> None:
        """`token_slots[t]`: the slot of row t of the step, -1 for the base model."""
        rows, counts = sort_rows(token_slots, self.max_loras)
        self.token_slots = torch.from_numpy(token_slots.astype(np.int32)) if rows.size else None
        if not self.use_triton:
            return
        # Whole tables, padding included: a graph padded past this step's rows reads blocks past its own. A
        # step of more rows than DECODE_ROWS is never padded down into the 16-row tiles, which skip its table.
        tables = [(table, block_table(counts, bm, table.shape[1])) for bm, table in self.tables.items()
                  if bm != BLOCK_MS[0] or token_slots.size <= DECODE_ROWS]
        packed = np.concatenate([rows.astype(np.int32)] + [host.ravel() for _, host in tables])
        # Pageable memory: CUDA stages it before returning, so the array may go at once.
        staged = torch.from_numpy(packed).to(self.sorted_token_ids.device, non_blocking=True)
        self.sorted_token_ids[:rows.size].copy_(staged[:rows.size])
        offset = rows.size
        for table, _ in tables:
            table.view(-1).copy_(staged[offset:offset + table.numel()])
            offset += table.numel()

    def expand_stacked(self, y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor,
                       slice_widths: tuple[int, ...]) -> torch.Tensor:
        """y (in place) += each adapter row's delta, from `shrunk` [T, slots * S * R]: every slot's x · A, as the
        stacked GEMM left it beside y."""
        if self.use_triton:
            table = self.tables[block_m_for(y.shape[0])]
            return lora_expand(y, shrunk, lora_b, self.sorted_token_ids, table, slice_widths)
        if self.token_slots is None:
            return y
        per_slot = shrunk.view(shrunk.shape[0], self.max_loras, -1)
        own = per_slot[torch.arange(shrunk.shape[0]), self.token_slots.long().clamp(min=0)].float()
        return lora_expand_reference(y, own, lora_b, self.token_slots, slice_widths)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 slice_widths: tuple[int, ...]) -> torch.Tensor:
        x = x if x.stride(-1) == 1 else x.contiguous()
        if self.use_triton:   # always launched: a graph captured with no adapter rows still serves steps with some
            table = self.tables[block_m_for(x.shape[0])]
            shrunk = lora_shrink(x, lora_a, self.sorted_token_ids, table)
            return lora_expand(y, shrunk, lora_b, self.sorted_token_ids, table, slice_widths)
        if self.token_slots is None:
            return y
        shrunk = lora_shrink_reference(x, lora_a, self.token_slots)
        return lora_expand_reference(y, shrunk, lora_b, self.token_slots, slice_widths)


class LoRALinearMethod:
    """A linear layer's quant method plus every slot's adapter weights for that layer: B [slots, R, N] with the
    scaling folded in, and A either stacked under the dense weight ([slots, S * R, K], see above) or apart as
    kernels/lora.py's shrink reads it ([slots, K, S * R])."""

    def __init__(self, base, batch: LoRABatch, layer: LinearBase, projections: tuple[str, ...], rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.base, self.batch, self.projections = base, batch, projections
        self.input_size = layer.input_size
        if isinstance(layer, PackedColumnLinear):
            self.slice_widths = tuple(size for _, size in layer.shard_offsets.values())
        else:
            self.slice_widths = (layer.output_size,)
        assert len(self.slice_widths) == len(projections)
        slots, sr, n = batch.max_loras, len(projections) * rank, sum(self.slice_widths)
        self.stacked: torch.Tensor | None = None
        if (type(base) is UnquantizedLinearMethod and layer.bias is None and layer.weight.dtype == dtype
                and slots * sr * self.input_size * dtype.itemsize <= STACK_MAX_BYTES):
            self.stacked = torch.zeros(n + slots * sr, self.input_size, dtype=dtype, device=device)
            self.stacked[:n].copy_(layer.weight)
            layer.weight = nn.Parameter(self.stacked[:n], requires_grad=False)   # the base weight, now a view
            self.lora_a = self.stacked[n:].view(slots, sr, self.input_size)
        else:
            self.lora_a = torch.zeros(slots, self.input_size, sr, dtype=dtype, device=device)
        self.lora_b = torch.zeros(slots, rank, n, dtype=dtype, device=device)

    def load_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy one adapter's (A [K, S * R], B) for this layer into `slot` (zeros where the adapter leaves it
        alone)."""
        if weights is None:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            return
        a = weights[0].to(self.lora_a.device, non_blocking=True)
        self.lora_a[slot].copy_(a.T if self.stacked is not None else a)
        self.lora_b[slot].copy_(weights[1], non_blocking=True)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.stacked is None:
            y = self.base.apply(layer, x, bias)
            return self.batch.add_lora(y, x, self.lora_a, self.lora_b, self.slice_widths)
        out = F.linear(x, self.stacked)
        n = self.lora_b.shape[2]
        # y stays a view with the slots' columns beside it: its consumers take a row stride, as q/k/v's do
        return self.batch.expand_stacked(out[:, :n], out[:, n:], self.lora_b, self.slice_widths)


def wrap_linear_layers(model: nn.Module, batch: LoRABatch, rank: int, dtype: torch.dtype,
                       device: torch.device) -> dict[str, LoRALinearMethod]:
    """Give every LoRA-capable linear layer of `model` a LoRALinearMethod; {module name: method}."""
    methods = {}
    for name, module in model.named_modules():
        projections = LORA_LAYERS.get(name.rpartition(".")[2])
        if projections is None or not isinstance(module, LinearBase):
            continue
        if isinstance(module, PackedColumnLinear) and len(module.shard_offsets) != len(projections):
            continue   # packs other projections than Llama's (no adapter targets it)
        method = LoRALinearMethod(module.quant_method, batch, module, projections, rank, dtype, device)
        module.quant_method = methods[name] = method
    # A norm or activation that quantizes its output for a W8A8 layer would hand a wrapped layer codes
    # instead of the activations its adapter multiplies.
    for module in model.modules():
        for producer, consumer in getattr(module, "input_quant_pairs", lambda: ())():
            if isinstance(getattr(module.get_submodule(consumer), "quant_method", None), LoRALinearMethod):
                module.get_submodule(producer).quantize_output = None
    return methods
