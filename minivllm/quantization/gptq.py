"""GPTQ checkpoints as AutoGPTQ / GPTQModel write them (`quant_method: "gptq"`).

Per linear layer with K inputs, N outputs, G = K / group_size groups, pf = 32 / bits:
  qweight [K / pf, N] int32  codes packed along the input dimension (field i of row j is input j*pf+i);
  qzeros  [G, N / pf] int32  zero points packed along the output dimension; checkpoint_format "gptq"
                             (v1) stores zero - 1, "gptq_v2" (GPTQModel) the zero itself;
  scales  [G, N] fp16;       g_idx [K] int32: the group of each input (read only with desc_act, whose act-order permutes it).
W[k, n] = (code[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n].
`lm_head: true` (GPTQModel's quantized LM head): `lm_head.qweight` etc. too, with N the vocabulary.
"""
from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed import get_tp_size
from minivllm.quantization.base import (QuantizationConfig, add_param, rank_part, shard_loader, shared_loader,
                                       splits_inputs)
from minivllm.quantization.packing import pack_factor, pack_rows, unpack_cols, unpack_rows
from minivllm.quantization.weight_only import WeightOnlyLinearMethod


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str = "gptq",
                 lm_head: bool = False):
        pack_factor(bits)
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}")
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0
        self.quantizes_lm_head = lm_head

    @classmethod
    def from_config(cls, config: dict) -> "GPTQConfig":
        return cls(int(config.get("bits", 4)), int(config.get("group_size", 128)), bool(config.get("desc_act", False)),
                   bool(config.get("sym", True)), config.get("checkpoint_format", "gptq"),
                   bool(config.get("lm_head", False)))

    def describe(self) -> str:
        extras = (", desc_act" if self.desc_act else "") + (", lm_head" if self.quantizes_lm_head else "")
        return f"gptq (int{self.bits}, group {self.group_size}{extras})"

    def get_quant_method(self, layer: nn.Module):
        return GPTQLinearMethod(self)


class GPTQLinearMethod(WeightOnlyLinearMethod):
    def __init__(self, config: GPTQConfig):
        super().__init__(config.bits, config.group_size)
        self.config = config
        self.zero_offset = config.zero_offset
        self.symmetric = config.sym

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        pf = pack_factor(self.bits)
        if input_size % pf or output_size % pf:
            raise ValueError(f"GPTQ int{self.bits} needs layer sizes divisible by {pf}, got {input_size}x{output_size}")
        _, groups = self.groups(input_size)
        add_param(layer, "qweight", (input_size // pf, output_size), torch.int32, shard_loader(layer, 1, 1, 0, pf))
        add_param(layer, "qzeros", (groups, output_size // pf), torch.int32, self.group_loader(layer, 1, pf))
        add_param(layer, "scales", (groups, output_size), torch.get_default_dtype(), self.group_loader(layer, 1))
        add_param(layer, "g_idx", (input_size,), torch.int32, self._g_idx_loader(layer))

    def _g_idx_loader(self, layer: nn.Module):
        """g_idx whole where a rank holds all inputs; a row-parallel rank keeps its inputs' entries, renumbered
        from its first group. Act-order's permuted g_idx is refused there: a rank's inputs would belong to every
        group and sort into runs of unequal length, which the GEMMs' fixed group size cannot express."""
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            if splits_inputs(layer):
                group = self.group_size if self.group_size > 0 else loaded.numel()
                in_order = torch.arange(loaded.numel(), device=loaded.device) // group
                if self.config.desc_act and not torch.equal(loaded.long(), in_order):
                    raise ValueError(f"act-order (desc_act) g_idx of a row-parallel layer cannot be split across "
                                     f"tensor_parallel_size {get_tp_size()}: each rank's inputs would span every "
                                     f"group of {group}; load it with tensor_parallel_size 1 or use a checkpoint "
                                     f"quantized without desc_act")
                loaded = rank_part(layer, loaded, None, None, input_dim=0) - layer.input_start // group
            shared_loader(param, loaded, shard_id)
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        K, N = layer.input_size, layer.output_size
        group_size, _ = self.groups(K)
        zeros = unpack_cols(layer.qzeros.data, self.bits, N) + self.config.zero_offset
        qweight, perm = layer.qweight.data, None
        g_idx = layer.g_idx.data.long()
        contiguous = torch.arange(K, device=g_idx.device) // group_size
        if self.config.desc_act and not torch.equal(g_idx, contiguous):
            # act-order: sort inputs by group so each group is a contiguous run; x is permuted alike.
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], contiguous):
                raise ValueError("g_idx does not assign group_size inputs to each group")
            qweight = pack_rows(unpack_rows(qweight, self.bits, K)[perm], self.bits)
        self.set_processed(layer, qweight, layer.scales.data, zeros, layer.scales.dtype, perm)
