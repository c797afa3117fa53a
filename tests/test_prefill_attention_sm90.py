"""The Hopper fresh-prompt attention kernel (Gluon) and the host fact that routes steps to it.

On the CPU the kernel cannot run (Gluon has no interpreter), so CI compiles it for sm_90 with the
ptxas that ships with Triton and checks that the result is what the kernel claims to be: wgmma, TMA
and per-partition register budgets. The `gpu` tests run it against the reference on ragged prompts.
"""
from __future__ import annotations

import pytest
import torch
import triton

from minivllm import LLM, SamplingParams
from tests.conftest import make_tiny_hf_checkpoint
from tests.test_kernels import assert_close, make_batch

CUDA_H100 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("head_dim,dtype,block_n,stages", [(128, torch.bfloat16, 128, 2),
                                                           (64, torch.float16, 64, 3)])
def test_kernel_compiles_for_sm90_to_wgmma_tma_and_register_budgets(head_dim, dtype, block_n, stages):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from minivllm.kernels import prefill_attention_sm90 as sm90

    def descriptor(heads, rows):
        x = torch.zeros(256, heads * head_dim, dtype=dtype)
        return mangle_type(TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, head_dim],
                                            sm90._layout(rows, head_dim, dtype)))

    q, kv = descriptor(32, 64), descriptor(8, block_n)
    pointer = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    signature = dict(q_desc=q, k_desc=kv, v_desc=kv, o_desc=q, out_ptr=pointer, query_start_loc_ptr="*i32",
                     qk_scale="fp32", num_seqs="i32", num_heads="i32", num_queries_per_kv="i32",
                     out_stride="i32", num_tiles_total="i32", BLOCK_N="constexpr", HEAD_DIM="constexpr",
                     STAGES="constexpr", CONSUMER_REGS="constexpr", PRODUCER_REGS="constexpr")
    constants = dict(BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=stages, CONSUMER_REGS=sm90.CONSUMER_REGS,
                     PRODUCER_REGS=sm90.PRODUCER_REGS)
    compiled = triton.compile(GluonASTSource(sm90._fresh_prefill_kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"]
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32" in ptx        # S = Q K^T
    assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32" in ptx       # O += P V
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx            # TMA loads
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx                # TMA stores of whole tiles
    assert "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx                      # the producer warp
    assert "setmaxnreg.dec.sync.aligned.u32 \t240" in ptx                     # the consumer warpgroups
    assert compiled.metadata.shared <= 227 * 1024


def test_exactly_the_steps_of_fresh_prompts_are_marked_fresh(tmp_path, monkeypatch):
    """Prefix hits, later chunks and decode steps carry context: only steps where every sequence
    starts at position 0 may take the kernel that reads this step's K/V alone."""
    from minivllm.worker import model_runner

    make_tiny_hf_checkpoint(tmp_path, "llama3")
    seen = []
    prepare = model_runner.prepare_inputs

    def spy(scheduler_output, *args, **kwargs):
        inputs = prepare(scheduler_output, *args, **kwargs)
        starts = scheduler_output.num_computed_tokens or [s.num_computed_tokens for s in scheduler_output.seqs]
        seen.append((list(starts), inputs.metadata.fresh_prompts))
        return inputs

    monkeypatch.setattr(model_runner, "prepare_inputs", spy)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
              enable_prefix_caching=True, kv_cache_memory=8 * 2**20, seed=0)
    shared = list(range(3, 51))                        # three full blocks: a prefix hit the second time
    prompts = [shared + [60, 61], list(range(10, 100)), [7, 8, 9]]   # the 90-token one is chunked
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": shared + [70]}], params, use_tqdm=False)
    assert all(fresh == (not any(starts)) for starts, fresh in seen), seen
    assert any(fresh for _, fresh in seen)
    assert ([48], False) in seen                        # the prefix hit: three cached blocks
    assert any(not fresh and 0 in starts for starts, fresh in seen)   # a fresh prompt beside a later chunk


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_H100, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("lengths,num_heads,num_kv_heads,head_dim,dtype", [
    ([1, 17, 64, 65, 127, 128, 129, 300, 512, 1000, 2049], 32, 8, 128, torch.bfloat16),
    ([5, 130, 257, 64], 8, 8, 128, torch.float16),
    ([200, 3, 1024, 77], 12, 4, 64, torch.bfloat16),
])
@pytest.mark.parametrize("programs", [1, 7, None])   # a few programs walk many tiles: ring phases carry over
def test_fresh_prompts_match_sdpa(lengths, num_heads, num_kv_heads, head_dim, dtype, programs):
    from minivllm.kernels.prefill_attention_sm90 import fresh_prefill_attention

    torch.manual_seed(0)
    total = sum(lengths)
    # q/k/v as views of one projection, as the model passes them.
    qkv = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda", dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q, k, v = (x.view(total, -1, head_dim) for x in (q, k, v))
    starts = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    scale = head_dim ** -0.5
    out = fresh_prefill_attention(q, k, v, starts, scale, programs=programs)
    for a, b in zip(starts.tolist()[:-1], starts.tolist()[1:]):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).float(), k[a:b].transpose(0, 1).float(), v[a:b].transpose(0, 1).float(),
            is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
        assert_close(out[a:b], want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_H100, reason="needs an sm_90 GPU")
def test_fresh_prompt_steps_take_the_hopper_kernel_and_agree_with_the_triton_one(monkeypatch):
    from minivllm.attention.torch_backend import write_kv_reference
    from minivllm.kernels import paged_prefill_attention
    from minivllm.kernels import prefill_attention_sm90 as sm90

    lengths = [37, 300, 129]
    query, key, value, k_cache, v_cache, metadata = make_batch(lengths, lengths, 8, 4, 128, torch.bfloat16,
                                                               seed=3)
    write_kv_reference(key, value, k_cache, v_cache, metadata.slot_mapping)
    args = (query, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, 0.088)
    calls = []
    real = sm90.fresh_prefill_attention
    monkeypatch.setattr(sm90, "fresh_prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    hopper = paged_prefill_attention(*args, max_query_len=300, key=key, value=value, fresh_prompts=True)
    assert calls == [1]
    triton_out = paged_prefill_attention(*args, max_query_len=300, key=key, value=value)
    windowed = paged_prefill_attention(*args, max_query_len=300, key=key, value=value, fresh_prompts=True,
                                       sliding_window=1 << 20)   # a per-layer option stays on Triton
    assert calls == [1]
    assert_close(hopper, triton_out, torch.bfloat16)
    assert_close(windowed, triton_out, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_H100, reason="needs an sm_90 GPU")
def test_engine_prompt_logprobs_through_the_hopper_kernel_match_the_triton_kernel(tmp_path, monkeypatch):
    """bf16 with head_dim 128, the kernel's shapes: eager steps of fresh prompts (some longer than the
    graphs take) score every prompt token as the Triton kernel does, through the real model's q/k/v views."""
    from minivllm.kernels import prefill_attention_sm90 as sm90

    make_tiny_hf_checkpoint(tmp_path, "llama3", hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=128, intermediate_size=256)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 130, 251)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs():
        llm = LLM(model=str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
                  gpu_memory_utilization=0.3, max_model_len=256)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        values = [[lp.logprob for entry in o.prompt_logprobs[1:] for lp in entry.values()] for o in outputs]
        del llm
        torch.cuda.empty_cache()
        return torch.tensor(sum(values, []))

    calls = []
    real = sm90.fresh_prefill_attention
    monkeypatch.setattr(sm90, "fresh_prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    hopper = prompt_logprobs()
    assert calls   # both layers of the prompt step
    monkeypatch.setattr(sm90, "fresh_prefill_supported", lambda *a: False)
    triton_kernel = prompt_logprobs()
    assert len(hopper) == sum(len(p) - 1 for p in prompts)
    torch.testing.assert_close(hopper, triton_kernel, atol=0.05, rtol=0.02)
