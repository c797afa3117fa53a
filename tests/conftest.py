"""Shared test fixtures: the default model's GGUF path, and tiny random HF checkpoints of each
supported architecture (the reference the model tests compare against); and how a CPU-only run spreads
test files over worker processes (pytest-xdist, `-n auto --dist loadfile` in pyproject.toml)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Before any kernel module is imported: Triton decides at decoration time whether a function is
    # interpreted, and a kernel calling a @triton.jit function decorated the other way fails.
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per worker: two workers with a thread per core each would oversubscribe the
    # cores, and OpenMP threads spinning at barriers then slow every matmul by an order of magnitude.
    # Subprocesses (servers, benchmark scripts, TP workers) inherit the setting.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

from minivllm.attention.metadata import AttentionMetadata, set_forward_context
from minivllm.layers.attention import Attention

MAX_CPU_WORKERS = 2   # fills a 2-core CI runner; each worker holds a few copies of the default model


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: test files run in up to two processes without a GPU (most of a CPU test is one
    interpreter thread), serially with one (the `gpu` tests share the device and its memory)."""
    cpus = os.cpu_count() or 1
    if torch.cuda.is_available() or cpus < 2:
        return 0
    return min(MAX_CPU_WORKERS, cpus)


def pytest_configure(config):
    """Before workers start, convert the default model's GGUF into the cache once, so that parallel
    workers find the finished folder instead of converting it side by side."""
    if getattr(config.option, "numprocesses", 0) and not hasattr(config, "workerinput"):
        from minivllm.models import loader
        from minivllm.models.gguf_loader import convert_gguf
        try:
            convert_gguf(loader.default_model_path())
        except FileNotFoundError:
            pass   # the tests that need the default model fail on their own, naming the package


# A GPU test that runs longer than this dumps every thread's stack and ends the process: a collective or a
# device wait that never returns holds the interpreter in C code, where pytest-level timeouts never fire,
# and faulthandler's watchdog is a C thread that needs no interpreter lock.
GPU_TEST_LIMIT_S = 240


@pytest.fixture(autouse=True)
def _gpu_test_deadline(request):
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    import faulthandler
    import sys
    faulthandler.dump_traceback_later(GPU_TEST_LIMIT_S, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from minivllm.models import loader
    return loader.default_model_path()


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """transformers loading the default model's GGUF on its own, in fp32: the reference. Loaded once per
    run (dequantizing the GGUF takes seconds) and only read: every test calls it under no_grad/inference
    mode and none changes its weights or configuration."""
    import os

    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(default_model_path),
                                                gguf_file=os.path.basename(default_model_path),
                                                dtype=torch.float32).eval()


def tiny_hf_config(arch: str):
    """A tiny transformers config per supported variant (fp32, 2 layers, vocab 128)."""
    import transformers
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    if arch == "llama3":
        # theta and original_max_position small, so the llama3 scaling changes angles at short positions.
        return transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, rope_theta=100.0)
    if arch == "llama-tied-bias":   # SmolLM2-like tied embeddings, plus every optional bias
        return transformers.LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True,
                                        mlp_bias=True, rope_theta=1000.0)
    if arch == "mistral":           # head_dim * heads != hidden_size
        return transformers.MistralConfig(**common, head_dim=32, sliding_window=None,
                                          tie_word_embeddings=False, rope_theta=10000.0)
    if arch == "qwen2":             # q/k/v bias, o_proj without
        return transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=10000.0)
    if arch == "qwen3":             # per-head q/k RMSNorm, explicit head_dim
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                                        rope_theta=1000000.0)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                       bos_token_id=1, eos_token_id=2)
    if arch == "qwen3-moe":         # layer 0 dense (mlp_only_layers), layer 1 sparse; top-k renormalised
        return transformers.Qwen3MoeConfig(**common, **moe, head_dim=16, norm_topk_prob=True,
                                           mlp_only_layers=[0], tie_word_embeddings=False)
    if arch == "qwen2-moe":         # shared expert with sigmoid gate; top-k not renormalised
        return transformers.Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=48,
                                           norm_topk_prob=False, tie_word_embeddings=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=None, tie_word_embeddings=False)
    if arch == "phi3":              # checkpoint already holds fused qkv_proj and gate_up_proj
        return transformers.Phi3Config(**common, sliding_window=None, tie_word_embeddings=False)
    if arch == "gemma":             # GeGLU, (1 + w) norms, sqrt(hidden)-scaled embeddings, tied
        return transformers.GemmaConfig(**common, head_dim=16, hidden_act="gelu_pytorch_tanh",
                                        tie_word_embeddings=True)
    if arch == "gemma2":            # window 8 (< the test prompts), caps that bite, attention scale != head_dim
        return transformers.Gemma2Config(**common, head_dim=16, hidden_activation="gelu_pytorch_tanh",
                                         query_pre_attn_scalar=8, sliding_window=8, attn_logit_softcapping=3.0,
                                         final_logit_softcapping=2.0, tie_word_embeddings=True,
                                         attn_implementation="eager")   # sdpa would ignore the soft cap
    if arch == "gemma3":            # + q/k norms, a second RoPE table (small theta) for the sliding layers
        return transformers.Gemma3TextConfig(
            **common, head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=8,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
            attn_implementation="eager")
    raise ValueError(f"unknown tiny architecture {arch!r}")


TINY_ARCHS = ("llama3", "llama-tied-bias", "mistral", "qwen2", "qwen3")
NEW_FAMILY_ARCHS = ("gpt2", "qwen3-moe", "qwen2-moe", "mixtral", "phi3", "gemma", "gemma2", "gemma3")


@torch.no_grad()
def make_tiny_hf_checkpoint(folder: Path, arch: str, seed: int = 0, **config_overrides):
    """Build a seeded random HF model of `arch`, save it (safetensors + config.json) into `folder`,
    and return it in eval mode as the reference. Every tensor is randomised, norms and biases too, so
    a misplaced weight cannot hide behind HF's ones/zeros initialisation."""
    import transformers
    torch.manual_seed(seed)
    config = tiny_hf_config(arch)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, param in model.named_parameters():
        if "norm" in name or ".ln_" in name:
            param.copy_(1.0 + 0.1 * torch.randn_like(param))
        else:
            param.copy_(0.08 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    return model.eval()


class PagedRun:
    """Drives a model the way the runner does: flat token batches, a paged KV cache per layer, block
    tables and slot mappings built by hand. `use_kv_cache=False` leaves the caches empty (the
    memory-profiling path: attention within each step's tokens only)."""

    def __init__(self, model, num_seqs: int, max_len: int, block_size: int = 4,
                 use_kv_cache: bool = True, seed: int = 0):
        self.model = model
        self.block_size = block_size
        blocks_per_seq = -(-max_len // block_size)
        num_blocks = num_seqs * blocks_per_seq
        # Scattered (not ascending) blocks, so a block-table mistake cannot pass by luck.
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_tables = order.view(num_seqs, blocks_per_seq).to(torch.int32)
        self.seq_lens = [0] * num_seqs
        dtype = next(model.parameters()).dtype
        for module in model.modules():
            if isinstance(module, Attention):
                shape = (num_blocks, block_size, module.num_kv_heads, module.head_dim)
                module.k_cache = torch.zeros(shape, dtype=dtype) if use_kv_cache else torch.tensor([])
                module.v_cache = torch.zeros(shape, dtype=dtype) if use_kv_cache else torch.tensor([])

    def step(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Append `new_tokens[i]` to sequence i; return each sequence's logits for those tokens."""
        input_ids, positions, slots, query_start_loc = [], [], [], [0]
        for i, tokens in enumerate(new_tokens):
            for pos in range(self.seq_lens[i], self.seq_lens[i] + len(tokens)):
                block = int(self.block_tables[i, pos // self.block_size])
                positions.append(pos)
                slots.append(block * self.block_size + pos % self.block_size)
            input_ids.extend(tokens)
            self.seq_lens[i] += len(tokens)
            query_start_loc.append(query_start_loc[-1] + len(tokens))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            block_tables=self.block_tables,
            max_query_len=max(len(t) for t in new_tokens),
            max_seq_len=max(self.seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=list(self.seq_lens))
        with torch.no_grad(), set_forward_context(meta):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
            logits = self.model.compute_logits(hidden)
        return [logits[query_start_loc[i]:query_start_loc[i + 1]] for i in range(len(new_tokens))]


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Max abs difference within 1e-3 of the logit scale (fp32 paths differ only in summation order)."""
    tolerance = 1e-3 * max(1.0, reference.abs().max().item())
    diff = (ours.float() - reference.float()).abs().max().item()
    assert diff <= tolerance, f"max abs diff {diff:.3g} > {tolerance:.3g}"
