"""FP8 KV cache (kv_cache_dtype="fp8"): quantization error within e4m3's precision, the reference and
Triton paged paths on fp8 caches, block sizing, swapping fp8 blocks, and whole engines.

e4m3 keeps 3 mantissa bits: rounding to nearest moves a value in the normal range (2^-6 .. 448, times
the scale) by at most 2^-4 of itself, a subnormal one by at most half the subnormal step (2^-10 times
the scale); beyond 448 x scale the cast saturates. The tolerances below are derived from that.
Triton runs under the interpreter on CPU (it loads, stores and converts float8_e4m3fn there).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.attention.torch_backend import (  # noqa: E402
    FP8_E4M3_MAX, TorchAttentionBackend, dequantize_kv, gather_context, paged_attention_reference,
    quantize_kv, write_kv_reference)
from minivllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from minivllm.cli import build_parser, engine_config_from_args  # noqa: E402
from minivllm.config import EngineConfig  # noqa: E402
from minivllm.kernels import write_kv  # noqa: E402
from minivllm.worker.kv_cache import kv_bytes_per_block, resolve_kv_cache_dtype  # noqa: E402
from minivllm.worker.swap import SwapSpace  # noqa: E402
from tests.test_kernels import DEVICE, assert_close, make_batch  # noqa: E402
from tests.test_swap import DRAFT_LAYERS, _llm, _prompts, tiny_model  # noqa: E402,F401  (tiny_model: a fixture)

FP8 = torch.float8_e4m3fn
UNIT_ROUNDOFF = 2.0 ** -4        # half an ulp, relative, for e4m3's 3 mantissa bits
SUBNORMAL_HALF_STEP = 2.0 ** -10  # half the spacing of e4m3's subnormals (2^-9), times the scale
MIN_NORMAL = 2.0 ** -6


def quantization_bound(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Largest |dequantize(quantize(x)) - x| that round-to-nearest e4m3 allows, elementwise."""
    return UNIT_ROUNDOFF * x.abs() + SUBNORMAL_HALF_STEP * scale


@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_quantize_kv_rounds_within_e4m3_precision_and_saturates(scale):
    g = torch.Generator().manual_seed(0)
    # Magnitudes from deep in the subnormal range to past saturation, both signs.
    x = torch.randn(20000, generator=g) * torch.exp2(torch.empty(20000).uniform_(-12, 10, generator=g)) * scale
    stored = quantize_kv(x, FP8, scale)
    assert stored.dtype == FP8 and not torch.isnan(stored.float()).any()
    back = dequantize_kv(stored, scale)
    in_range = x.abs() <= FP8_E4M3_MAX * scale
    assert ((back - x).abs() <= quantization_bound(x, scale) + 1e-12)[in_range].all()
    normal = in_range & (x.abs() >= MIN_NORMAL * scale)
    relative = ((back - x).abs() / x.abs())[normal]
    assert relative.max() <= UNIT_ROUNDOFF and relative.mean() > UNIT_ROUNDOFF / 8  # really rounded
    assert torch.equal(back[~in_range].abs(), torch.full_like(back[~in_range], FP8_E4M3_MAX * scale))
    # Values already on the e4m3 grid come back exactly; non-fp8 caches only cast.
    assert torch.equal(dequantize_kv(quantize_kv(back, FP8, scale), scale), back)
    assert torch.equal(quantize_kv(x, torch.float32, scale), x)


def _decode_batch(dtype, seed=3, num_kv_heads=2, group=3, head_dim=40):
    """Decode rows over odd contexts (one empty), fresh caches of `dtype`, written by the reference."""
    seq_lens = [29, 1, 53, 0]
    query, key, value, k_cache, v_cache, metadata = make_batch(
        seq_lens, [1] * len(seq_lens), num_kv_heads, group, head_dim, torch.float32, block_size=8, seed=seed)
    return query, key, value, k_cache.to(dtype), v_cache.to(dtype), metadata


def test_reference_attention_on_fp8_cache_is_attention_on_the_dequantized_values():
    query, _, _, k_cache, v_cache, metadata = _decode_batch(torch.float32)
    k_scale, v_scale = 0.5, 0.125
    k8, v8 = quantize_kv(k_cache, FP8, k_scale), quantize_kv(v_cache, FP8, v_scale)
    args = (metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_tables, 40 ** -0.5)
    out = paged_attention_reference(query, k8, v8, *args, k_scale=k_scale, v_scale=v_scale)
    expected = paged_attention_reference(query, dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale), *args)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.02, 0.01)])
def test_reference_attention_with_fp8_cache_stays_within_the_e4m3_error_bound(k_scale, v_scale):
    """Keys off by e_j (|e_j| <= u|k_j| + eta) shift score j by at most delta_j = c sum|q||e_j|; the
    softmax weights then change by a factor within exp(+-2 max delta), so the output moves by at most
    max_j |v_j error| + (exp(2 max delta) - 1) sum_j p_j |v_j - out| (exact, not first order)."""
    query, key, value, k_cache, v_cache, metadata = _decode_batch(torch.float32, seed=7)
    scale = 40 ** -0.5
    k8, v8 = quantize_kv(k_cache, FP8, k_scale), quantize_kv(v_cache, FP8, v_scale)   # the cached prefix
    write_kv_reference(key, value, k_cache, v_cache, metadata.slot_mapping)
    write_kv_reference(key, value, k8, v8, metadata.slot_mapping, k_scale, v_scale)
    args = (metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_tables, scale)
    exact = paged_attention_reference(query, k_cache, v_cache, *args)
    out = paged_attention_reference(query, k8, v8, *args, k_scale=k_scale, v_scale=v_scale)
    group = query.shape[1] // k_cache.shape[2]
    checked = 0
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        if seq_len == 0:
            continue
        k = gather_context(k_cache, metadata.block_tables[i], seq_len).repeat_interleave(group, 1).transpose(0, 1)
        v = gather_context(v_cache, metadata.block_tables[i], seq_len).repeat_interleave(group, 1).transpose(0, 1)
        q = query[i][:, None, :]                                                     # [H, 1, D]
        p = torch.softmax((q * k).sum(-1) * scale, dim=-1)                          # [H, s]
        delta = (scale * (q.abs() * quantization_bound(k, k_scale)).sum(-1)).amax(-1)  # [H]
        value_error = quantization_bound(v, v_scale).amax(1)                         # [H, D]
        spread = (p[:, :, None] * (v - exact[i][:, None, :]).abs()).sum(1)          # [H, D]
        bound = value_error + torch.expm1(2 * delta)[:, None] * spread + 1e-5
        error = (out[i] - exact[i]).abs()
        assert (error <= bound).all() and error.max() > 0   # quantized, and no worse than e4m3 allows
        checked += 1
    assert checked == 3


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.01, 0.004)])
def test_triton_write_kv_quantizes_exactly_like_the_reference(k_scale, v_scale):
    g = torch.Generator().manual_seed(2)
    fused = (torch.randn(7, 2, 3, 24, generator=g) * 3).to(DEVICE)    # strided key/value, 3 heads, dim 24
    fused[0, 0, 0, :4] = torch.tensor([1e4, -1e4, 500.0, 2e-7])        # saturating and subnormal values
    key, value = fused[:, 0], fused[:, 1]
    slot_mapping = torch.tensor([5, -1, 17, 44, 16, -1, 40], device=DEVICE)
    k_cache = torch.zeros(6, 8, 3, 24, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    write_kv_reference(key, value, expected_k, expected_v, slot_mapping, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    saturated = torch.tensor([FP8_E4M3_MAX, -FP8_E4M3_MAX]) * k_scale
    assert torch.equal(dequantize_kv(k_cache[0, 5, 0, :2], k_scale).cpu(), saturated)


# (seq_lens, query_lens, group, head_dim, dtype, decode partition): decode rows split and unsplit,
# then a mixed batch (chunk after a cached prefix, a fresh prompt, a decode) through the varlen kernel.
TRITON_CASES = [
    ([29, 1, 53, 0], [1, 1, 1, 1], 3, 40, torch.float32, 16),
    ([29, 1, 53], [1, 1, 1], 4, 64, torch.bfloat16, None),
    ([37, 19, 6], [11, 19, 1], 3, 40, torch.float32, None),
    ([37, 19, 6], [11, 19, 1], 2, 64, torch.bfloat16, None),
]


@pytest.mark.parametrize("seq_lens,query_lens,group,head_dim,dtype,partition_size", TRITON_CASES)
def test_triton_paged_attention_on_fp8_cache_matches_the_reference(seq_lens, query_lens, group, head_dim,
                                                                   dtype, partition_size):
    query, key, value, k_cache, v_cache, metadata = make_batch(
        seq_lens, query_lens, 2, group, head_dim, dtype, block_size=8, seed=len(seq_lens) + group)
    k_scale, v_scale = 0.03, 0.02
    k_cache = quantize_kv(k_cache, FP8, k_scale)   # the cached prefix, already in fp8
    v_cache = quantize_kv(v_cache, FP8, v_scale)
    reference_k, reference_v = k_cache.clone(), v_cache.clone()
    backend, reference = TritonAttentionBackend(decode_partition_size=partition_size), TorchAttentionBackend()
    backend.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
    reference.write_kv(key, value, reference_k, reference_v, metadata.slot_mapping, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), reference_k.view(torch.uint8))
    out = backend.attend(query, k_cache, v_cache, metadata, head_dim ** -0.5, k_scale, v_scale)
    expected = reference.attend(query, reference_k, reference_v, metadata, head_dim ** -0.5, k_scale, v_scale)
    rows = metadata.query_start_loc_cpu[-1]
    assert_close(out[:rows], expected[:rows], dtype)


def test_kv_cache_dtype_names_sizes_and_bad_values():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == FP8
    assert kv_bytes_per_block(2, 16, 8, 128, FP8) * 2 == kv_bytes_per_block(2, 16, 8, 128, torch.bfloat16)
    for bad in ("fp8_e5m2", "int8", "bf16"):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig(kv_cache_dtype=bad)
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            resolve_kv_cache_dtype(bad, torch.float32)
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert engine_config_from_args(args).kv_cache_dtype == "fp8"
    assert engine_config_from_args(build_parser().parse_args(["serve"])).kv_cache_dtype == "auto"


def test_swap_space_round_trips_fp8_blocks_bit_exactly():
    g = torch.Generator().manual_seed(4)
    kv = quantize_kv(torch.randn(2, 3, 6, 4, 2, 8, generator=g) * 50, FP8)   # [2, layers, blocks, bs, heads, dim]
    original = kv.clone()
    space = SwapSpace([kv], num_blocks=3)
    assert space.nbytes == 2 * 3 * 3 * 4 * 2 * 8   # one byte per element
    space.apply([(1, 0), (4, 2)], [])
    kv[:, :, [1, 4]] = quantize_kv(torch.zeros(1), FP8)
    space.apply([], [(2, 1), (0, 5)])
    assert torch.equal(kv[:, :, 1].view(torch.uint8), original[:, :, 4].view(torch.uint8))
    assert torch.equal(kv[:, :, 5].view(torch.uint8), original[:, :, 1].view(torch.uint8))
    assert kv.dtype == FP8


# ---- whole engines ----------------------------------------------------------------------------------

def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def test_engine_fp8_cache_doubles_blocks_over_bf16_and_quadruples_over_fp32(tiny_model):
    runners = {(dtype, kv): _llm(tiny_model, dtype=dtype, kv_cache_dtype=kv).llm_engine.runner
               for dtype, kv in [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")]}
    fp32, bf16, fp8 = runners.values()
    assert fp8.kv_cache.dtype == FP8 and bf16.kv_cache.dtype == torch.bfloat16
    assert fp8.kv_budget_bytes == bf16.kv_budget_bytes == fp32.kv_budget_bytes
    # Same budget: blocks = budget // bytes per block, and an fp8 block is half a bf16 block.
    assert fp8.num_blocks == fp8.kv_budget_bytes // (fp8.kv_cache.numel() // fp8.num_blocks)
    assert fp8.num_blocks >= 1.9 * bf16.num_blocks and fp8.num_blocks >= 3.9 * fp32.num_blocks


def _next_token_choices(llm, prompt) -> list[int]:
    """Teacher-forced top-1 next token at each prompt position (prompt logprobs): one flipped near-tie
    cannot derail the positions after it, as it would in free-running greedy decoding."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    entries = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs[1:]
    return [next(t for t, lp in entry.items() if lp.rank == 1) for entry in entries]


def _agreement(choices: list[list[int]]) -> float:
    auto, fp8 = choices
    return sum(a == b for a, b in zip(auto, fp8)) / len(auto)


def test_engine_next_token_choices_with_fp8_cache_mostly_agree_with_auto(tiny_model):
    prompt = {"prompt_token_ids": torch.randint(3, 120, (100,), generator=torch.Generator().manual_seed(1)).tolist()}
    choices = [_next_token_choices(_llm(tiny_model, kv_cache_dtype=kv), prompt) for kv in ("auto", "fp8")]
    # e4m3 moves each key and value by up to 2^-4 of itself: a near-tie in the logits may flip.
    assert _agreement(choices) >= 0.9


@pytest.mark.parametrize("variant", [{}, {"speculative_config": DRAFT_LAYERS}], ids=["plain", "draft_layers"])
def test_engine_with_fp8_cache_swaps_blocks_and_keeps_its_outputs(tiny_model, variant):
    prompts = _prompts(8)
    params = [SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True) for i in range(len(prompts))]
    reference = _tokens(_llm(tiny_model, kv_cache_dtype="fp8"), prompts, params)
    llm = _llm(tiny_model, kv_cache_dtype="fp8", num_gpu_blocks_override=40, preemption_mode="swap",
               swap_space=0.001, **variant)
    engine = llm.llm_engine
    assert engine.runner.swap_space.cpu_caches[0].element_size() == 1
    engine.scheduler.config.swap_min_tokens = 8
    assert _tokens(llm, prompts, params) == reference
    assert engine.get_stats().num_swap_outs > 0


def test_engine_fp8_copy_on_write_gives_n_greedy_samples_the_single_sample_tokens(tiny_model):
    # Prompts of 11 and 14 tokens end inside a 4-token block that the n samples share: the first write
    # to it copies the fp8 block (ModelRunner._copy_blocks), and every sample must continue identically.
    prompts = _prompts(3)[1:]
    llm = _llm(tiny_model, kv_cache_dtype="fp8")
    single = _tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [[s.token_ids for s in o.outputs] for o in outputs] == [[t] * 3 for t in single]


def test_checkpoint_kv_cache_scales_are_loaded_in_vllm_spellings_and_applied(tiny_model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(tiny_model, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.04)            # compressed-tensors
    tensors["model.layers.0.self_attn.v_proj.output_scale"] = torch.tensor([0.02])  # Quark
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.03)           # one for both
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompts = _prompts(3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = _llm(str(tmp_path), kv_cache_dtype="fp8")
    layers = llm.llm_engine.runner.attention_layers
    assert [a.k_scale for a in layers] + [a.v_scale for a in layers] == pytest.approx([0.04, 0.03, 0.02, 0.03])
    _tokens(llm, prompts, params)
    unscaled = _llm(tiny_model, kv_cache_dtype="fp8")
    _tokens(unscaled, prompts, params)
    # Same requests, same slots: layer 0's cached keys are those of the unscaled run divided by 0.04
    # (each side rounded to e4m3, so within 2 x 2^-4).
    unscaled_keys = unscaled.llm_engine.runner.attention_layers[0].k_cache
    ratio = layers[0].k_cache.float().abs().max() / unscaled_keys.float().abs().max()
    assert abs(ratio / 25 - 1) <= 2 * UNIT_ROUNDOFF
    # A model-dtype cache ignores the scales: the same tokens as the checkpoint without them.
    assert _tokens(_llm(str(tmp_path)), prompts, params) == _tokens(_llm(tiny_model), prompts, params)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(-1.0)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="positive"):
        _llm(str(tmp_path))


def test_real_model_next_token_choices_with_fp8_cache_mostly_agree_with_auto():
    text = ("The Roman Empire was the post-Republican state of ancient Rome. It included large territorial "
            "holdings around the Mediterranean Sea in Europe, North Africa, and Western Asia, and was ruled "
            "by emperors. From the accession of Caesar Augustus to the military anarchy of the third "
            "century, it was a principate with Italia as the metropole of its provinces.")
    choices = [_next_token_choices(LLM(kv_cache_memory=16 * 2**20, max_model_len=256, kv_cache_dtype=kv,
                                       enable_prefix_caching=False), text) for kv in ("auto", "fp8")]
    assert len(choices[0]) > 60 and _agreement(choices) >= 0.9


# ---- GPU ---------------------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("query_lens", [[1] * 64, [1] * 6 + [1000, 700]], ids=["decode", "mixed"])
def test_gpu_triton_fp8_paths_match_the_reference(query_lens):
    seq_lens = [4096] * 6 + [1000, 3700] if len(query_lens) == 8 else \
        torch.randint(1, 4097, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    query, key, value, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, 8, 4, 128, torch.bfloat16,
                                                               seed=5)
    k_cache, v_cache = quantize_kv(k_cache, FP8, 0.05), quantize_kv(v_cache, FP8, 0.05)
    reference_k, reference_v = k_cache.clone(), v_cache.clone()
    backend, reference = TritonAttentionBackend(), TorchAttentionBackend()
    backend.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, 0.05, 0.05)
    reference.write_kv(key, value, reference_k, reference_v, metadata.slot_mapping, 0.05, 0.05)
    assert (k_cache.view(torch.uint8) != reference_k.view(torch.uint8)).float().mean() < 1e-4
    out = backend.attend(query, k_cache, v_cache, metadata, 128 ** -0.5, 0.05, 0.05)
    expected = reference.attend(query, reference_k, reference_v, metadata, 128 ** -0.5, 0.05, 0.05)
    rows = metadata.query_start_loc_cpu[-1]
    assert_close(out[:rows], expected[:rows], torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_gpu_engine_fp8_cache_holds_about_twice_the_tokens():
    """Same model and memory share: the fp8 pool has ~2x the blocks, and generates through the Triton
    kernels and CUDA graphs."""
    import gc
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                  gpu_memory_utilization=0.15, kv_cache_dtype=kv, max_model_len=1024, max_num_seqs=8)
        blocks[kv] = llm.llm_engine.runner.num_blocks
        out = llm.generate([{"prompt_token_ids": p} for p in _prompts(4)],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
        del llm, out
        gc.collect()
        torch.cuda.empty_cache()   # the next engine's profile must not see this one's memory
    assert blocks["fp8"] >= 1.9 * blocks["auto"], blocks
