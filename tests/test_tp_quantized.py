"""Tensor parallelism over quantized checkpoints: each rank cuts its part of every format's tensors.

Tiny random Llama checkpoints (intermediate 128, groups of 32: each rank's down_proj inputs are two whole
groups, its o_proj inputs one) in every format the engine loads from a checkpoint. Each rank's weights, as
its GEMMs use them, must be exactly TP = 1's part of them (both ranks loaded in this process: loading
needs no peer). Two ranks for real (a worker process, gloo) give TP = 1's greedy tokens in fp32 on GPTQ,
and stay within activation rounding on W8A8. Splits a format cannot express are refused clearly.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.distributed import parallel_state
from minivllm.models.loader import load_model, resolve_model
from minivllm.quantization.w8a8 import FP8
from tests.conftest import make_tiny_hf_checkpoint
from tests.test_quant_formats import FORMATS, GROUP, dequantized_weight, gptq_tensors, write_quantized

# asymmetric GPTQ (v1 zeros) in input order: zero points vary, so a misplaced qzeros cut shows
GPTQ_ASYM = (gptq_tensors, False, False, {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                          "desc_act": False, "sym": False})


def write_w8a8(folder, reference, fmt: str) -> None:
    """fp8 as AutoFP8 writes it (one scale per checkpoint tensor: q, k and v each their own), int8 as
    llm-compressor's W8A8 scheme (per-channel scales [N, 1], compressed-tensors int-quantized)."""
    tensors = {}
    for name, tensor in reference.state_dict().items():
        if not name.endswith("proj.weight"):
            tensors[name] = tensor.contiguous()
            continue
        if fmt == "fp8":
            scale = tensor.abs().max() / 448.0
            codes, stored = (tensor / scale).to(FP8), scale.reshape(())
        else:
            scale = tensor.abs().amax(dim=1, keepdim=True) / 127.0
            codes, stored = torch.round(tensor / scale).clamp(-127, 127).to(torch.int8), scale
        tensors[name], tensors[name.replace("weight", "weight_scale")] = codes, stored.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    int8_symmetric = {"num_bits": 8, "type": "int", "symmetric": True}
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"} if fmt == "fp8" else {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**int8_symmetric, "strategy": "channel"},
                                      "input_activations": {**int8_symmetric, "strategy": "token", "dynamic": True}}}}
    (folder / "config.json").write_text(json.dumps(config))


def write_checkpoint(folder, fmt: str, intermediate_size: int = 128) -> None:
    reference = make_tiny_hf_checkpoint(folder, "llama3", intermediate_size=intermediate_size)
    if fmt in ("fp8", "int8"):
        write_w8a8(folder, reference, fmt)
    else:
        write_quantized(folder, reference, fmt, spec=GPTQ_ASYM if fmt == "gptq" else FORMATS[fmt])


FORMATS_TP = ["gptq", "awq", "compressed-tensors", "fp8", "int8"]


def load_as(folder, monkeypatch, rank: int, size: int):
    """The model rank `rank` of `size` builds and loads (loading needs no peer, so no group is started)."""
    monkeypatch.setattr(parallel_state, "_RANK", rank)
    monkeypatch.setattr(parallel_state, "_SIZE", size)
    return load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"))


def dense_weight(layer) -> torch.Tensor:
    """A quantized layer's weight [N, K] as it computes with it."""
    if hasattr(layer, "qweight"):
        return dequantized_weight(layer)
    return layer.weight.float() * layer.weight_scale.view(-1, 1)


def tp1_part(layer, full: torch.Tensor) -> torch.Tensor:
    """The rows / columns of the whole weight that `layer` (one rank's) should hold."""
    if hasattr(layer, "shard_sources"):   # qkv, gate_up: each projection's own part, stacked
        return torch.cat([full[start + layer.shard_sources[k]:][:layer.shard_offsets[k][1]]
                          for k, (start, _) in layer.full_shard_offsets.items()])
    if hasattr(layer, "input_start"):
        return full[:, layer.input_start:layer.input_start + layer.input_size]
    return full


@pytest.mark.parametrize("fmt", FORMATS_TP)
def test_each_rank_holds_its_part_of_the_tp1_weights(tmp_path, monkeypatch, fmt):
    """Column-parallel layers cut their output rows (qkv and gate_up each projection on its own; codes and
    zero points packed along outputs in whole words), row-parallel ones their input columns (codes packed
    along inputs, scales and zero points in whole groups); per-channel scales follow their rows, per-tensor
    scales are replicated. Both ranks' weights, as their GEMMs use them, are exactly TP = 1's parts."""
    write_checkpoint(tmp_path, fmt)
    whole = {name: dense_weight(m) for name, m in load_as(tmp_path, monkeypatch, 0, 1).named_modules()
             if hasattr(m, "qweight") or hasattr(m, "weight_scale")}
    assert len(whole) == 2 * 4
    for rank in (0, 1):
        for name, layer in load_as(tmp_path, monkeypatch, rank, 2).named_modules():
            if name in whole:
                assert torch.equal(dense_weight(layer), tp1_part(layer, whole[name])), (rank, name)


def generate(folder, tp: int):
    """Greedy tokens of two prompts and the second's prompt logprobs."""
    llm = LLM(model=str(folder), dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=tp,
              max_model_len=128, kv_cache_memory=4 << 20)
    prompts = [{"prompt_token_ids": torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
               for n in (7, 29)]
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0),
                               use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outputs],
                torch.tensor([next(iter(p.values())).logprob for p in outputs[1].prompt_logprobs[1:]]))
    finally:
        llm.llm_engine.shutdown()


def test_tp2_greedy_matches_tp1_on_a_gptq_checkpoint(tmp_path):
    """Two ranks (a worker process, gloo) on asymmetric GPTQ: the row-parallel GEMMs use their own groups
    and renumbered g_idx, and the all-reduced sums give TP = 1's tokens."""
    write_checkpoint(tmp_path, "gptq")
    (tokens, logprobs), (reference, reference_logprobs) = generate(tmp_path, 2), generate(tmp_path, 1)
    assert tokens == reference
    torch.testing.assert_close(logprobs, reference_logprobs, rtol=0, atol=1e-4)


def test_tp2_w8a8_stays_within_activation_rounding_of_tp1(tmp_path):
    """int8 W8A8 on two ranks: the weights are TP = 1's (above), but each rank quantizes the activations it
    holds with its own per-token scale, so row-parallel layers round their inputs differently from one
    rank; prompt logprobs stay within that rounding (measured: at most 0.024 apart here)."""
    write_checkpoint(tmp_path, "int8")
    (_, logprobs), (_, reference_logprobs) = generate(tmp_path, 2), generate(tmp_path, 1)
    torch.testing.assert_close(logprobs, reference_logprobs, rtol=0, atol=0.1)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_row_parallel_inputs_inside_a_group_are_refused(tmp_path, monkeypatch, fmt):
    """Intermediate 96 on two ranks: down_proj's 48 inputs per rank are not whole groups of 32."""
    write_checkpoint(tmp_path, fmt, intermediate_size=96)
    with pytest.raises(ValueError, match=r"mlp\.down_proj.*inputs 48\.\.96 of rank 1 \(tensor_parallel_size 2\) "
                                         r"are not whole groups of 32 inputs"):
        load_as(tmp_path, monkeypatch, 1, 2)


def test_act_order_is_refused_on_row_parallel_layers(tmp_path, monkeypatch):
    """desc_act's permuted g_idx would give each rank inputs of every group (qkv and gate_up hold all
    their inputs and would load; down_proj and o_proj are refused)."""
    write_checkpoint(tmp_path, "gptq-asym-desc-act")
    with pytest.raises(ValueError, match=r"down_proj\.g_idx.*act-order \(desc_act\).*tensor_parallel_size 2"):
        load_as(tmp_path, monkeypatch, 1, 2)


def test_quantized_moe_experts_are_refused(tmp_path):
    """FusedMoE holds unquantized expert weights only, at any TP size: a quantized expert tensor is named."""
    make_tiny_hf_checkpoint(tmp_path, "qwen3-moe")
    tensors = {name.replace(".weight", ".qweight") if ".experts." in name else name: tensor
               for name, tensor in load_file(str(tmp_path / "model.safetensors")).items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.0\.\w+\.qweight'?: quantized MoE experts are not supported"):
        load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
