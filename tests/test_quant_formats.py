"""Weight-only checkpoint formats (GPTQ, AWQ, compressed-tensors) loaded from their on-disk layouts.

The packed tensors are built here by a reference packing written from each format's description
(plain Python bit arithmetic over numpy uint32, independent of minivllm's packing code). A tiny HF
model is quantized group-wise in the test, written in the format, loaded through the normal loader;
the loaded model must (1) hold exactly the weights the test dequantizes, (2) stay within half a
quantization step of the original weights, (3) give the logits transformers gives with those
dequantized weights.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.conftest import PagedRun, assert_logits_close, make_tiny_hf_checkpoint
from minivllm.models.loader import load_model, resolve_model
from minivllm.quantization.packing import dequantize

GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize_groups(w: torch.Tensor, g_idx: np.ndarray, sym: bool, bits: int = 4):
    """w [N, K] -> (codes [K, N] unsigned, scales [G, N], zeros [G, N]) with W ~ (code - zero) * scale.
    Asymmetric zeros stay >= 1 so that GPTQ v1's stored zero - 1 is never negative."""
    w = w.double().numpy()
    groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    codes = np.zeros(w.T.shape, dtype=np.int64)
    scales = np.zeros((groups, w.shape[0]))
    zeros = np.zeros((groups, w.shape[0]), dtype=np.int64)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        block = w[:, cols]
        lo, hi = np.minimum(block.min(axis=1), 0), np.maximum(block.max(axis=1), 0)
        if sym:
            scale = np.maximum(-lo, hi) / ((top + 1) // 2 - 1)
        else:
            scale = (hi - lo) / (top - 1)
        scale = np.float16(scale).astype(np.float64)   # the checkpoint stores fp16 scales
        zero = np.full(w.shape[0], (top + 1) // 2) if sym else np.clip(np.round(-lo / scale), 1, top)
        codes[cols, :] = np.clip(np.round(block / scale[:, None]) + zero[:, None], 0, top).T
        scales[g], zeros[g] = scale, zero
    return codes, scales, zeros


def words(fields: list[np.ndarray], bits: int = 4) -> torch.Tensor:
    """Field i of each uint32 word goes to bits [i*bits, (i+1)*bits)."""
    word = np.zeros(fields[0].shape, dtype=np.uint32)
    for i, field in enumerate(fields):
        word |= (field.astype(np.uint32) & ((1 << bits) - 1)) << np.uint32(i * bits)
    return torch.from_numpy(word.view(np.int32).copy())


def gptq_tensors(codes, scales, zeros, g_idx):
    """AutoGPTQ v1: qweight [K/8, N] along inputs, qzeros [G, N/8] along outputs holding zero - 1."""
    return {"qweight": words([codes[i::8] for i in range(8)]),
            "qzeros": words([zeros[:, i::8] - 1 for i in range(8)]),
            "scales": torch.tensor(scales, dtype=torch.float16),
            "g_idx": torch.tensor(g_idx, dtype=torch.int32)}


def awq_tensors(codes, scales, zeros, g_idx):
    """AutoAWQ GEMM: qweight [K, N/8], field i of word c is output column 8c + AWQ_ORDER[i]."""
    return {"qweight": words([codes[:, AWQ_ORDER[i]::8] for i in range(8)]),
            "qzeros": words([zeros[:, AWQ_ORDER[i]::8] for i in range(8)]),
            "scales": torch.tensor(scales, dtype=torch.float16)}


def compressed_tensors(codes, scales, zeros, g_idx):
    """pack-quantized: weight_packed [N, K/8], field i of word c is input 8c + i, holding q + 8."""
    signed_plus_8 = (codes - zeros[g_idx] + 8).T        # [N, K]
    return {"weight_packed": words([signed_plus_8[:, i::8] for i in range(8)]),
            "weight_scale": torch.tensor(scales.T, dtype=torch.float16),
            "weight_shape": torch.tensor(list(signed_plus_8.shape), dtype=torch.int64)}


FORMATS = {
    "gptq-sym": (gptq_tensors, True, False, {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                             "desc_act": False, "sym": True}),
    "gptq-asym-desc-act": (gptq_tensors, False, True, {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                                       "desc_act": True, "sym": False}),
    "awq": (awq_tensors, False, False, {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                        "zero_point": True, "version": "gemm"}),
    "compressed-tensors": (compressed_tensors, True, False, {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}}),
}


def write_quantized(folder, reference, fmt: str, seed: int = 0, spec: tuple | None = None):
    """Quantize every decoder linear of `reference` into `folder` in format `fmt` (or `spec`, a tuple
    as FORMATS holds); returns {name: dequantized W [N, K]} and replaces the reference's weights with them."""
    pack, sym, act_order, qconfig = spec or FORMATS[fmt]
    rng = np.random.default_rng(seed)
    tensors, expected, orders = {}, {}, {}
    for name, tensor in reference.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name == "lm_head.weight" and reference.config.tie_word_embeddings:
            continue   # tied checkpoints store the embedding only
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS):
            tensors[name] = tensor.contiguous()
            continue
        K = tensor.shape[1]
        g_idx = np.arange(K) // GROUP
        if act_order:   # one order per input: projections of the same input share it (as in GPTQ)
            site = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            g_idx = g_idx[orders.setdefault(site, rng.permutation(K))]
        codes, scales, zeros = quantize_groups(tensor, g_idx, sym)
        for key, value in pack(codes, scales, zeros, g_idx).items():
            tensors[f"{module}.{key}"] = value.contiguous()
        deq = ((codes - zeros[g_idx]) * scales[g_idx]).T
        expected[name] = torch.tensor(deq, dtype=torch.float32)
        step = torch.tensor(scales[g_idx].T, dtype=torch.float32)
        assert ((expected[name] - tensor).abs() <= step * 0.501).all(), "test quantizer out of its step"
        with torch.no_grad():
            tensor.copy_(expected[name])
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(config))
    return expected


def dequantized_weight(module) -> torch.Tensor:
    """A weight-only layer's weight [N, K] as our layout holds it, inputs back in checkpoint order."""
    group_size, _ = module.quant_method.groups(module.input_size)
    w = dequantize(module.qweight, module.scales, module.zeros, group_size, 4, module.input_size)
    if module.perm is not None:   # act-order: our rows are in permuted input order
        w = w[torch.argsort(module.perm)]
    return w.t()


def loaded_weight(model, layer: int, proj: str) -> torch.Tensor:
    """Our model's dequantized weight [N, K] for one checkpoint projection (slicing packed layers)."""
    block = model.model.layers[layer]
    packed = {"q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
              "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", None),
              "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
              "down_proj": ("mlp.down_proj", None)}
    module_name, shard = packed[proj]
    module = block.get_submodule(module_name)
    w = dequantized_weight(module)
    if shard is not None:
        start, size = module.shard_offsets[shard]
        w = w[start:start + size]
    return w


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_loader_reads_format_built_by_reference_packing(fmt, tmp_path):
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3")
    expected = write_quantized(tmp_path, reference, fmt)
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    for name, weight in expected.items():
        parts = name.split(".")
        torch.testing.assert_close(loaded_weight(model, int(parts[2]), parts[4]), weight, rtol=0, atol=1e-6)
    # symmetric checkpoints (every zero point 8) are marked so: the one-row GEMV then reads no zeros
    sym = FORMATS[fmt][1]
    assert {layer.zero_point for layer in model.modules() if hasattr(layer, "qweight")} == {8 if sym else None}

    sequences = [[3, 5, 7, 11, 13, 17], [19, 23, 29]]
    run = PagedRun(model, len(sequences), 8)
    with torch.no_grad():
        for seq, ours in zip(sequences, run.step(sequences)):
            assert_logits_close(ours, reference(torch.tensor([seq])).logits[0])


def test_quantization_option_must_match_checkpoint(tmp_path):
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3")
    write_quantized(tmp_path, reference, "awq")
    with pytest.raises(ValueError, match="quantized with 'awq'"):
        load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), quantization="gptq")


def test_unknown_quantization_is_rejected(tmp_path):
    make_tiny_hf_checkpoint(tmp_path, "llama3")
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), quantization="int3")
    with pytest.raises(ValueError, match="needs a checkpoint quantized"):
        load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), quantization="gptq")


@pytest.mark.parametrize("quantization", ["gptq", "awq", "compressed-tensors", "fp8", "int8"])
def test_dummy_weights_in_every_format_have_bf16_dummy_scale(quantization):
    """load_format="dummy" creates weights directly in the format (no full-precision copy, so 70B int4
    fits one GPU), with the N(0, 0.02) spread of plain dummy weights."""
    from minivllm.quantization.packing import dequantize as dequantize_weights
    source = resolve_model("tiny-llama", "dummy")
    model = load_model(source, torch.float32, torch.device("cpu"), "dummy", 0, quantization)
    layer = model.model.layers[0].mlp.down_proj
    if hasattr(layer, "qweight"):
        group_size, _ = layer.quant_method.groups(layer.input_size)
        w = dequantize_weights(layer.qweight, layer.scales, layer.zeros, group_size, 4, layer.input_size)
    else:
        assert layer.weight.element_size() == 1
        w = layer.weight.float() * layer.weight_scale.view(-1, 1)
    assert model.quant_config.name == quantization
    assert 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 0.005
    if hasattr(layer, "qweight"):   # dummy asymmetric weights have zero points the GEMVs must read, as real ones do
        symmetric = quantization != "awq"
        assert (layer.zero_point == 8) == symmetric and (layer.zeros.unique().numel() == 1) == symmetric


def test_cli_quantization_flags():
    from minivllm.cli import build_parser, engine_config_from_args
    args = build_parser().parse_args(["serve", "folder", "--quantization", "fp8"])
    assert engine_config_from_args(args).quantization == "fp8"
    args = build_parser().parse_args(["quantize", "m", "--method", "gptq", "--calib", "c.txt", "--out", "o",
                                      "--desc-act", "--group-size", "64"])
    assert (args.method, args.bits, args.group_size, args.desc_act, args.sym) == ("gptq", 4, 64, True, None)
    args = build_parser().parse_args(["quantize", "--method", "smoothquant", "--alpha", "0.3", "--calib", "c.txt",
                                      "--out", "o"])
    assert (args.model, args.method, args.alpha) == (None, "smoothquant", 0.3)
    args = build_parser().parse_args(["eval-ppl", "m", "--text", "t.txt", "--quantization", "int8"])
    assert (args.window, args.stride, engine_config_from_args(args).quantization) == (1024, 512, "int8")


def write_quantized_lm_head(folder, reference) -> torch.Tensor:
    """GPTQModel's `lm_head: true`: the head in GPTQ layout too (act-order), the embedding left as it was
    (a tied model's head gets its own tensors); returns the dequantized head, now also the reference's."""
    weight = reference.lm_head.weight.detach().clone()
    K = weight.shape[1]
    g_idx = (np.arange(K) // GROUP)[np.random.default_rng(1).permutation(K)]
    codes, scales, zeros = quantize_groups(weight, g_idx, sym=False)
    tensors = {name: t for name, t in load_file(str(folder / "model.safetensors")).items() if name != "lm_head.weight"}
    tensors.update({f"lm_head.{key}": value.contiguous()
                    for key, value in gptq_tensors(codes, scales, zeros, g_idx).items()})
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["lm_head"] = True
    (folder / "config.json").write_text(json.dumps(config))
    head = torch.tensor(((codes - zeros[g_idx]) * scales[g_idx]).T, dtype=torch.float32)
    reference.lm_head.weight = torch.nn.Parameter(head.clone(), requires_grad=False)   # unties a tied reference
    return head


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("arch", ["llama3", "llama-tied-bias"])
def test_gptq_quantized_lm_head(arch, device, tmp_path):
    """A GPTQ checkpoint with `lm_head: true` (the head in the format as well, act-order; on a tied model the
    embedding keeps its own weight): the head holds exactly the test's dequantized weight and the logits match
    transformers with it; the engine reports the head's quantization."""
    reference = make_tiny_hf_checkpoint(tmp_path, arch)
    write_quantized(tmp_path, reference, "gptq-asym-desc-act")
    head = write_quantized_lm_head(tmp_path, reference)
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device(device))
    assert not hasattr(model.lm_head, "weight") and model.quant_config.describe().endswith("lm_head)")
    torch.testing.assert_close(dequantized_weight(model.lm_head).cpu(), head, rtol=0, atol=1e-6)
    assert torch.equal(model.model.embed_tokens.weight.cpu(), reference.model.embed_tokens.weight)
    with torch.no_grad():
        if device == "cuda":   # the head's CUDA GEMM (GEMV at one row) on hidden states
            for rows in (1, 5, 40):
                hidden = torch.randn(rows, head.shape[1], device=device)
                torch.testing.assert_close(model.compute_logits(hidden).cpu(), hidden.cpu() @ head.t(),
                                           rtol=1e-3, atol=1e-3)
            return
        sequences = [[3, 5, 7, 11, 13, 17], [19, 23, 29]]
        for seq, logits in zip(sequences, PagedRun(model, len(sequences), 8).step(sequences)):
            assert_logits_close(logits, reference(torch.tensor([seq])).logits[0])


def test_int4_layer_norms_in_gemvs_fall_back_to_the_norm_kernels(tmp_path, monkeypatch):
    """A Llama layer whose int4 projections norm their input (layers/fusion.PendingNorm, taken at one token on
    Hopper) gives, where the GEMV declines at run time (here: on the CPU), the norm layer's output and residual
    stream: decoding one token at a time, the logits equal those of the plain layer bit for bit, and
    transformers'. Off the GPU, at two tokens and for unquantized layers, the plain path is taken."""
    from minivllm.quantization.weight_only import WeightOnlyLinearMethod
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3")
    write_quantized(tmp_path, reference, "gptq-sym")
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    layer = model.model.layers[0]
    one, two = torch.zeros(1, 64), torch.zeros(2, 64)
    assert layer.norms_in_gemvs(one) == (False, False)
    tokens = [3, 5, 7, 11, 13]
    plain = PagedRun(model, 1, 8)
    expected = torch.cat([plain.step([[t]])[0] for t in tokens])
    monkeypatch.setattr(WeightOnlyLinearMethod, "norms_input", lambda self, layer, x: True)
    assert layer.norms_in_gemvs(one) == (True, True) and layer.norms_in_gemvs(two) == (False, False)
    pending = PagedRun(model, 1, 8)
    ours = torch.cat([pending.step([[t]])[0] for t in tokens])
    assert torch.equal(ours, expected)
    with torch.no_grad():
        assert_logits_close(ours, reference(torch.tensor([tokens])).logits[0])
    (tmp_path / "plain").mkdir()
    make_tiny_hf_checkpoint(tmp_path / "plain", "llama3")
    unquantized = load_model(resolve_model(str(tmp_path / "plain")), torch.float32, torch.device("cpu"))
    assert unquantized.model.layers[0].norms_in_gemvs(one) == (False, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_loader_reads_format_onto_cuda(fmt, tmp_path):
    """Checkpoint tensors are read on the CPU and land on the GPU: every loader path, GPTQ's g_idx shared
    by the shards of packed layers included (its check compared a CUDA tensor with a CPU one)."""
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3")
    expected = write_quantized(tmp_path, reference, fmt)
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cuda"))
    for name, weight in expected.items():
        parts = name.split(".")
        ours = loaded_weight(model, int(parts[2]), parts[4]).cpu()
        torch.testing.assert_close(ours, weight, rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gemv_epilogues_fused_at_one_row_on_hopper(fmt, tmp_path):
    """In bf16 on an sm_90 GPU, at one row, a Llama MLP's SiLU runs in gate_up's int4 GEMV epilogue
    (layers/fusion.gate_up_activation) and attention's rotary embedding in qkv_proj's (layers/fusion.qkv_rotary),
    each giving what the GEMV and the separate kernel give, act-order permutation included; two rows take the
    separate kernels. A layer's norms handed to its GEMVs (PendingNorm) give what the norm kernel and the GEMV
    give apart, the residual stream included."""
    from minivllm.layers.fusion import PendingNorm, gate_up_activation, qkv_rotary
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernel is Hopper's")
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3")
    write_quantized(tmp_path, reference, fmt)
    model = load_model(resolve_model(str(tmp_path)), torch.bfloat16, torch.device("cuda"))
    mlp = model.model.layers[1].mlp
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    fused = mlp.gate_up_proj.quant_method.apply_silu_and_mul(mlp.gate_up_proj, x)
    assert fused is not None and fused.shape == (1, 96)
    apart = mlp.act_fn(mlp.gate_up_proj(x))
    torch.testing.assert_close(fused.float(), apart.float(), rtol=2e-2, atol=2e-2 * apart.abs().max().item())
    assert torch.equal(gate_up_activation(mlp.gate_up_proj, mlp.act_fn, x), fused)
    two = x.repeat(2, 1)
    assert mlp.gate_up_proj.quant_method.apply_silu_and_mul(mlp.gate_up_proj, two) is None
    # the same two kernels as apart, at two rows (whose GEMM tile the tuner picks: compared with itself)
    torch.testing.assert_close(gate_up_activation(mlp.gate_up_proj, mlp.act_fn, two),
                               mlp.act_fn(mlp.gate_up_proj(two)))
    # attention: q and k rotated in qkv_proj's epilogue, against the projection and the rotary kernel apart
    attn = model.model.layers[1].self_attn
    positions = torch.tensor([11], device="cuda")
    fused, rotated = qkv_rotary(attn.qkv_proj, attn.rotary_emb, positions, x, attn.head_dim,
                                attn.num_heads + attn.num_kv_heads)
    assert rotated
    qkv = attn.qkv_proj(x)
    q, k, _ = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    attn.rotary_emb(positions, q.view(1, -1, attn.head_dim), k.view(1, -1, attn.head_dim))   # in place, in qkv
    torch.testing.assert_close(fused.float(), qkv.float(), rtol=2e-2, atol=2e-2 * qkv.abs().max().item())
    assert not qkv_rotary(attn.qkv_proj, attn.rotary_emb, positions.repeat(2), two, attn.head_dim,
                          attn.num_heads + attn.num_kv_heads)[1]

    # each norm, with the residual add before it, in the GEMV that reads it (act-order declines: the norm's
    # weights and the residual would have to follow the permutation; the norm kernel runs first)
    layer = model.model.layers[1]
    post, pre = layer.post_attention_layernorm, layer.input_layernorm
    assert layer.norms_in_gemvs(x) == (fmt != "gptq-asym-desc-act",) * 2
    hidden, residual = ((torch.randn(1, 64, generator=torch.Generator().manual_seed(seed)) * 30).to(torch.bfloat16)
                        .cuda() for seed in (4, 6))
    normed, stream = post(hidden, residual)
    pending = PendingNorm.of(post, hidden, residual)
    assert (mlp.gate_up_proj.quant_method.apply_silu_and_mul(mlp.gate_up_proj, hidden, norm=pending) is None) \
        == (fmt == "gptq-asym-desc-act")
    pending = PendingNorm.of(post, hidden, residual)
    apart = mlp.act_fn(mlp.gate_up_proj(normed))
    ours = gate_up_activation(mlp.gate_up_proj, mlp.act_fn, pending)
    torch.testing.assert_close(ours.float(), apart.float(), rtol=2e-2, atol=2e-2 * apart.abs().max().item())
    assert torch.equal(pending.stream, stream)
    for residual_in in (None, residual):   # the first layer has no residual yet: the stream is x itself
        pending = PendingNorm.of(pre, hidden, residual_in)
        ours, rotated = qkv_rotary(attn.qkv_proj, attn.rotary_emb, positions, pending, attn.head_dim,
                                   attn.num_heads + attn.num_kv_heads)
        normed = pre(hidden) if residual_in is None else pre(hidden, residual_in)[0]
        apart, _ = qkv_rotary(attn.qkv_proj, attn.rotary_emb, positions, normed, attn.head_dim,
                              attn.num_heads + attn.num_kv_heads)
        assert rotated
        torch.testing.assert_close(ours.float(), apart.float(), rtol=2e-2, atol=2e-2 * apart.abs().max().item())
        assert torch.equal(pending.stream, hidden if residual_in is None else stream)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["gptq-asym-desc-act", "gptq-sym"])
def test_int4_bf16_engine_decode_matches_transformers_logprobs(fmt, tmp_path):
    """A GPTQ model served in bf16 through the engine (CUDA graphs; at one row on Hopper its GEMVs carry the
    SiLU, the rotary embedding and, without act-order, the norms and residual adds): each decoded token's
    logprob equals transformers' (fp32, the checkpoint's dequantized weights) on the same tokens, within bf16's
    tolerance."""
    from minivllm import LLM, SamplingParams
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3")
    write_quantized(tmp_path, reference, fmt)
    reference = reference.cuda()
    llm = LLM(model=str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              max_model_len=256)
    assert llm.llm_engine.runner.graph_runner is not None
    prompt = torch.randint(3, 128, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=24, logprobs=1,
                                                                      ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ids = prompt + out.token_ids
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([ids], device="cuda")).logits[0].float(), dim=-1)
    for i, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        want = expected[len(prompt) - 1 + i, token].item()
        assert abs(logprobs[token].logprob - want) < 0.05 + 0.02 * abs(want), (i, logprobs[token].logprob, want)
