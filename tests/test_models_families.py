"""GPT-2, the MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral), Phi-3 and Gemma (1, 2, 3) against transformers: tiny random checkpoints
built with transformers' own classes give the same fp32 logits (prefill and paged decode), and the engine
generates transformers' greedy tokens under batching, chunked prefill and prefix-cache hits."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import NEW_FAMILY_ARCHS, PagedRun, make_tiny_hf_checkpoint, tiny_hf_config
from minivllm import LLM, SamplingParams
from minivllm.models.loader import load_model, resolve_model
from minivllm.models.registry import get_model_class

PROMPT_LENS = (5, 9, 3)
DECODE_STEPS = 6
MAX_TOKENS = 10


def assert_logits_equal(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """fp32: within 1e-4 (relative to the logit scale when that exceeds one)."""
    tolerance = 1e-4 * max(1.0, reference.abs().max().item())
    diff = (ours - reference).abs().max().item()
    assert diff <= tolerance, f"max abs diff {diff:.3g} > {tolerance:.3g}"


@pytest.fixture(scope="module", params=NEW_FAMILY_ARCHS)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_tiny_hf_checkpoint(folder, request.param)


def test_prefill_and_decode_logits_match_transformers(checkpoint):
    arch, folder, reference = checkpoint
    source = resolve_model(str(folder))
    model = load_model(source, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    vocab = source.hf_config.vocab_size
    sequences = [torch.randint(vocab, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    run = PagedRun(model, len(sequences), max(PROMPT_LENS) + DECODE_STEPS)
    with torch.no_grad():
        for seq, ours in zip(sequences, run.step(sequences)):
            assert_logits_equal(ours, reference(torch.tensor([seq])).logits[0])
        for _ in range(DECODE_STEPS):
            next_tokens = [[int(t)] for t in torch.randint(vocab, (len(sequences),), generator=generator)]
            for seq, token, ours in zip(sequences, next_tokens, run.step(next_tokens)):
                seq.extend(token)
                assert_logits_equal(ours[0], reference(torch.tensor([seq])).logits[0, -1])


def test_engine_greedy_matches_transformers_with_chunks_and_prefix_hits(checkpoint):
    arch, folder, reference = checkpoint
    generator = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 128, (20,), generator=generator).tolist()   # > one block: prefix hits
    prompts = [shared + torch.randint(3, 128, (n,), generator=generator).tolist() for n in (3, 7, 1)]
    prompts.append(torch.randint(3, 128, (11,), generator=generator).tolist())
    with torch.no_grad():
        expected = [reference.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    llm = LLM(model=str(folder), dtype="float32", skip_tokenizer_init=True, kv_cache_memory=4 << 20,
              max_model_len=128, max_num_batched_tokens=8, max_num_seqs=3, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(out.num_cached_tokens > 0 for out in second)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected


def test_moe_experts_load_into_stacked_weights(tmp_path):
    """Each expert's gate/up/down lands in its slice of w13 / w2 (Mixtral's w1/w3/w2 names)."""
    make_tiny_hf_checkpoint(tmp_path, "mixtral")
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    experts = model.model.layers[0].mlp.experts
    size = experts.intermediate_size
    for e in range(experts.num_experts):
        prefix = f"model.layers.0.block_sparse_moe.experts.{e}"
        torch.testing.assert_close(experts.w13_weight[e, :size], tensors[f"{prefix}.w1.weight"])
        torch.testing.assert_close(experts.w13_weight[e, size:], tensors[f"{prefix}.w3.weight"])
        torch.testing.assert_close(experts.w2_weight[e], tensors[f"{prefix}.w2.weight"])
    missing = {k: v for k, v in tensors.items() if "experts.3.w3" not in k}
    with pytest.raises(ValueError, match="lacks"):
        model.load_weights(missing.items())
    with pytest.raises(ValueError, match="unknown expert shard"):
        experts.weight_loader(experts.w13_weight, tensors[f"{prefix}.w1.weight"], (9, "w1"))


def test_registry_lists_supported_architectures():
    expected = {"gpt2": "GPT2LMHeadModel", "qwen3-moe": "Qwen3MoeForCausalLM",
                "qwen2-moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM",
                "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "gemma3": "Gemma3ForCausalLM"}
    for arch, class_name in expected.items():
        assert get_model_class(tiny_hf_config(arch)).__name__ == class_name   # by model_type
    import transformers
    with pytest.raises(ValueError, match=r"supported: \[.*GPT2LMHeadModel.*MixtralForCausalLM"):
        get_model_class(transformers.BertConfig(architectures=["BertForMaskedLM"]))


def test_shipped_configs_have_the_real_parameter_counts():
    """Built on the meta device: the counts of the published checkpoints."""
    expected = {"gpt2": 124_439_808, "gpt2-xl": 1_557_611_200, "qwen3-30b-a3b": 30_532_122_624,
                "mixtral-8x7b": 46_702_792_704, "phi-3-mini": 3_821_079_552, "gemma-2b": 2_506_172_416,
                "gemma-2-9b": 9_241_705_984, "gemma-3-1b": 999_885_952}
    for name, count in expected.items():
        config = resolve_model(name, load_format="dummy").hf_config
        with torch.device("meta"):
            model = get_model_class(config)(config)
        assert sum(p.numel() for p in model.parameters()) == count, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", NEW_FAMILY_ARCHS)
def test_gpu_fp32_greedy_matches_transformers(arch, tmp_path):
    """On CUDA (Triton attention and MoE kernel, CUDA graphs for decode and mixed steps) the greedy
    tokens still equal transformers'."""
    reference = make_tiny_hf_checkpoint(tmp_path, arch).cuda()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              max_model_len=256, max_num_batched_tokens=48, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    with torch.inference_mode():
        expected = [reference.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert ours == expected


def write_gpt2_gguf(model, path) -> None:
    """A GGUF file laid out as llama.cpp's converter writes GPT-2 (f32 tensors, no vocabulary)."""
    import gguf
    config = model.config
    block = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    top = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(4 * config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    for name, tensor in model.state_dict().items():
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight":
            continue
        module, _, suffix = name.rpartition(".")
        if module.startswith("h."):
            _, layer, rest = module.split(".", 2)
            gguf_name = f"blk.{layer}.{block[rest]}.{suffix}"
            if suffix == "weight" and rest in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
                tensor = tensor.t()   # Conv1D [in, out] -> [out, in], as llama.cpp stores it
        else:
            gguf_name = f"{top[module]}.{suffix}"
        writer.add_tensor(gguf_name, tensor.contiguous().numpy())
        if gguf_name == "token_embd.weight":
            writer.add_tensor("output.weight", tensor.contiguous().numpy())   # llama.cpp's tied copy
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gpt2_from_gguf_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    reference = make_tiny_hf_checkpoint(tmp_path / "hf", "gpt2")
    write_gpt2_gguf(reference, tmp_path / "tiny-gpt2.gguf")
    source = resolve_model(str(tmp_path / "tiny-gpt2.gguf"))
    assert source.hf_config.model_type == "gpt2" and source.tokenizer_dir is None
    model = load_model(source, torch.float32, torch.device("cpu"))
    sequences = [[5, 9, 17, 3, 88], [100, 2]]
    with torch.no_grad():
        for seq, ours in zip(sequences, PagedRun(model, 2, 8).step(sequences)):
            assert_logits_equal(ours, reference(torch.tensor([seq])).logits[0])
