"""The Hopper prefill attention kernel (Gluon), its per-step query-tile plan, and the split of a step
between it and the Triton kernel.

On the CPU the kernel cannot run (Gluon has no interpreter), so CI compiles it for sm_90 with the
ptxas that ships with Triton and checks that the result is what the kernel claims to be: wgmma, TMA
and per-partition register budgets; the plan and the Triton kernel's half of the split run on the
CPU. The `gpu` tests run the kernel against the reference on ragged prompts, chunks after a cached
prefix and mixed steps, eagerly and replayed from a CUDA graph padded as the runner pads its own.
"""
from __future__ import annotations

import pytest
import torch
import triton

from minivllm import LLM, SamplingParams
from minivllm.attention.torch_backend import paged_attention_reference, write_kv_reference
from tests.conftest import make_tiny_hf_checkpoint
from tests.test_kernels import assert_close, make_batch

CUDA_H100 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _compile_for_sm90(head_dim, dtype, block_n, stages):
    """(PTX, shared bytes, whether a cubin came out) of the kernel compiled for sm_90; run in a fresh
    process, since an interpreted Triton library function (tl.sum and the like, in every CPU kernel
    test) leaves triton.language patched for the interpreter in the process it ran in, and a Gluon kernel
    compiled there afterwards fails (a warm Triton cache hid that: it skips the compile)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from minivllm.kernels import prefill_attention_sm90 as sm90

    def descriptor(heads, rows, columns=head_dim):
        x = torch.zeros(256, heads * head_dim, dtype=dtype)
        return mangle_type(TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, columns],
                                            sm90._layout(rows, columns, dtype)))

    q, kv, page = descriptor(32, 64), descriptor(8, block_n), descriptor(8, 16, sm90.PAGE_COLUMNS)
    pointer = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    signature = dict(q_desc=q, k_desc=kv, v_desc=kv, kp_desc=page, vp_desc=page, o_desc=q, out_ptr=pointer,
                     plan_ptr="*i32", block_tables_ptr="*i32",
                     block_table_stride="i32", qk_scale="fp32", num_heads="i32", num_queries_per_kv="i32",
                     out_stride="i32", BLOCK_N="constexpr", HEAD_DIM="constexpr", STAGES="constexpr",
                     CONSUMER_REGS="constexpr", PRODUCER_REGS="constexpr")
    constants = dict(BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=stages, CONSUMER_REGS=sm90.CONSUMER_REGS,
                     PRODUCER_REGS=sm90.PRODUCER_REGS)
    compiled = triton.compile(GluonASTSource(sm90._prefill_kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    return compiled.asm["ptx"], compiled.metadata.shared, bool(compiled.asm["cubin"])


@pytest.mark.parametrize("head_dim,dtype,block_n,stages", [(128, torch.bfloat16, 128, 2),
                                                           (64, torch.float16, 64, 3)])
def test_kernel_compiles_for_sm90_to_wgmma_tma_and_register_budgets(head_dim, dtype, block_n, stages):
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        ptx, shared, has_cubin = pool.apply(_compile_for_sm90, (head_dim, dtype, block_n, stages))
    assert has_cubin
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32" in ptx        # S = Q K^T
    assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32" in ptx       # O += P V
    loads = [line for line in ptx.splitlines() if "cp.async.bulk.tensor.2d.shared::cluster.global" in line]
    # Q (two boxes of 64 rows), K and V of this step, and K and V of the prefix: one box per
    # 16-token page and 64 columns. (A whole-tile box wider than the swizzle is issued as two.)
    halves = head_dim // 64
    assert len(loads) == 2 * halves + 2 * halves + 2 * (block_n // 16) * halves, len(loads)
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx                # TMA stores of whole tiles
    assert "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx                     # the producer warp
    assert "setmaxnreg.dec.sync.aligned.u32 \t240" in ptx                    # the consumer warpgroups
    assert shared <= 227 * 1024


def plan_reference(query_lens, seq_lens, min_query_len):
    """(sequence, tile) of every 128-row query tile of the long sequences, and the keys each reads."""
    tiles = []
    for seq, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if query_len >= min_query_len:
            for tile in range(-(-query_len // 128)):
                tiles.append(((seq, tile), seq_len - query_len + min((tile + 1) * 128, query_len)))
    return tiles


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([512] * 8, [512] * 8),                                   # fresh prompts
    ([1, 300, 64, 63, 1, 129, 6], [900, 300, 2000, 63, 17, 1129, 40]),   # chunks, prefix hits, decode rows
    ([1, 1, 5], [10, 20, 30]),                                # nothing long: an empty plan
    ([70] + [0] * 5, [70] + [0] * 5),                         # padding sequences, as in a graph
])
def test_query_tile_plan_lists_the_long_sequences_tiles_heaviest_first(query_lens, seq_lens):
    """The plan kernel (run by Triton's interpreter here) against its torch reference, and both against
    the plan's definition."""
    from minivllm.kernels import prefill_attention_sm90 as sm90

    starts = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    num_tokens = int(starts[-1]) + 13   # padding rows after the last sequence
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    plan = sm90.plan_query_tiles(starts, lens, num_tokens)
    assert torch.equal(plan, sm90.plan_query_tiles_reference(starts, lens, num_tokens))
    want = plan_reference(query_lens, seq_lens, sm90.MIN_QUERY_LEN)
    assert int(plan[0, 1]) == sum(0 < n < sm90.MIN_QUERY_LEN for n in query_lens)   # the Triton kernel's
    count = int(plan[0, 0])
    assert plan.dtype == torch.int32 and count == len(want) and plan.shape == (plan.shape[0], sm90.PLAN_ROW.value)
    assert plan.shape[0] - 1 >= count
    rows = plan[1:count + 1].tolist()
    assert sorted((seq, first_row // 128) for seq, *_, first_row, _, _, _ in rows) == sorted(t for t, _ in want)
    for seq, start, query_len, context_len, *_ in rows:
        assert (start, query_len, context_len) == (int(starts[seq]), query_lens[seq], seq_lens[seq] - query_lens[seq])
    keys = dict(want)
    assert [keys[(seq, first_row // 128)] for seq, *_, first_row, _, _, _ in rows] == sorted(keys.values(),
                                                                                           reverse=True)


def test_the_triton_kernel_leaves_the_long_sequences_to_the_hopper_one(monkeypatch):
    """With a plan, paged_prefill_attention hands the sequences of >= MIN_QUERY_LEN query rows to the
    Hopper kernel (here a stand-in that marks their rows) and computes exactly the others itself."""
    from minivllm.kernels import paged_prefill_attention
    from minivllm.kernels import prefill_attention_sm90 as sm90

    seq_lens, query_lens = [80, 30, 100, 7], [70, 2, 64, 1]
    query, key, value, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, 2, 2, 16, torch.float32,
                                                               seed=4)
    write_kv_reference(key, value, k_cache, v_cache, metadata.slot_mapping)
    marked = []

    def stand_in(query, key, value, k_cache, v_cache, block_tables, plan, scale, out=None, **kwargs):
        marked.append(int(plan[0, 0]))
        out.fill_(7.0)   # every row: the Triton kernel must then overwrite exactly the short ones
        return out

    monkeypatch.setattr(sm90, "supported", lambda *args: True)
    monkeypatch.setattr(sm90, "prefill_attention", stand_in)
    args = (query, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, 0.25)
    plan = sm90.plan_query_tiles(metadata.query_start_loc, metadata.seq_lens, query.shape[0])
    out = paged_prefill_attention(*args, max_query_len=70, min_query_len=1, key=key, value=value,
                                  query_tile_plan=plan)
    expected = paged_attention_reference(query, k_cache, v_cache, metadata.query_start_loc_cpu, seq_lens,
                                         metadata.block_tables, 0.25)
    assert marked == [2]   # one 128-row tile for each of the two long sequences
    for (start, end), query_len in zip(zip(metadata.query_start_loc_cpu, metadata.query_start_loc_cpu[1:]),
                                       query_lens):
        if query_len >= sm90.MIN_QUERY_LEN:
            assert (out[start:end] == 7.0).all()
        else:
            assert_close(out[start:end], expected[start:end], torch.float32)
    # A step whose shortest run is long (the host knows) launches no Triton kernel; a per-layer option keeps
    # the whole step there.
    assert (paged_prefill_attention(*args, max_query_len=70, min_query_len=64, key=key, value=value,
                                    query_tile_plan=plan) == 7.0).all()
    windowed = paged_prefill_attention(*args, max_query_len=70, key=key, value=value, query_tile_plan=plan,
                                       sliding_window=1 << 20)
    assert marked == [2, 2]
    assert_close(windowed, expected, torch.float32)
    # A step with no short sequence, where only the plan knows it (a graph): two long sequences and a
    # padding one; the Triton kernel leaves every row alone (reading the plan's count, it stops at once).
    starts = torch.tensor([0, 70, 134, 134], dtype=torch.int32)
    lengths = torch.tensor([80, 100, 0], dtype=torch.int32)
    plan = sm90.plan_query_tiles(starts, lengths, query.shape[0])
    assert int(plan[0, 1]) == 0
    out = paged_prefill_attention(query, k_cache, v_cache, starts, lengths, metadata.block_tables[:3], 0.25,
                                  max_query_len=70, key=key, value=value, query_tile_plan=plan)
    assert (out == 7.0).all()


def test_steps_tell_the_backend_their_shortest_query_run(tmp_path, monkeypatch):
    """min_query_len is the host's fact that spares the Triton launch when every sequence is long."""
    from minivllm.worker import model_runner

    make_tiny_hf_checkpoint(tmp_path, "llama3")
    seen = []
    prepare = model_runner.prepare_inputs

    def spy(scheduler_output, *args, **kwargs):
        inputs = prepare(scheduler_output, *args, **kwargs)
        seen.append((list(scheduler_output.num_scheduled_tokens), inputs.metadata.min_query_len))
        return inputs

    monkeypatch.setattr(model_runner, "prepare_inputs", spy)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=256, max_num_batched_tokens=64,
              max_num_seqs=8, kv_cache_memory=8 * 2**20, seed=0)
    prompts = [list(range(3, 53)), list(range(10, 100)), [7, 8, 9]]   # the 90-token one is chunked
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=3,
                                                                            ignore_eos=True), use_tqdm=False)
    assert all(shortest == min(counts) for counts, shortest in seen), seen
    assert any(shortest == 1 and max(counts) > 1 for counts, shortest in seen)   # a chunk beside decodes


def run_hopper(seq_lens, query_lens, num_kv_heads, group, head_dim, dtype, seed, programs=None):
    """The kernel on a make_batch step (this step's K/V written to the cache first, as the layer does):
    (its output, NaN where it must not write, and the reference)."""
    from minivllm.kernels import prefill_attention_sm90 as sm90

    query, key, value, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, num_kv_heads, group,
                                                               head_dim, dtype, seed=seed)
    write_kv_reference(key, value, k_cache, v_cache, metadata.slot_mapping)
    plan = sm90.plan_query_tiles(metadata.query_start_loc, metadata.seq_lens, query.shape[0])
    out = sm90.prefill_attention(query, key, value, k_cache, v_cache, metadata.block_tables, plan,
                                 head_dim ** -0.5, out=torch.full_like(query, float("nan")), programs=programs)
    expected = paged_attention_reference(query, k_cache, v_cache, metadata.query_start_loc_cpu,
                                         metadata.seq_lens_cpu, metadata.block_tables, head_dim ** -0.5)
    return out, expected, metadata.query_start_loc_cpu


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_H100, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("seq_lens,query_lens,num_kv_heads,group,head_dim,dtype", [
    ([1, 17, 64, 65, 127, 128, 129, 300, 512, 1000, 2049], None, 8, 4, 128, torch.bfloat16),   # fresh
    # after a cached prefix: 636 (not a whole page), 1767, 171, 2000 (a decode row), 16 (one page)
    ([700, 1000, 2100, 300, 90, 2001, 80], [64, 1000, 333, 129, 90, 1, 64], 8, 4, 128, torch.bfloat16),
    ([130, 2057, 64, 900], [130, 1000, 64, 5], 8, 1, 128, torch.float16),
    ([1200, 3, 1024, 277], [200, 3, 1024, 77], 4, 3, 64, torch.bfloat16),   # GQA 3, head_dim 64
])
@pytest.mark.parametrize("programs", [1, 7, None])   # a few programs walk many tiles: ring phases carry over
def test_long_query_runs_match_the_reference(seq_lens, query_lens, num_kv_heads, group, head_dim, dtype,
                                              programs):
    from minivllm.kernels.prefill_attention_sm90 import MIN_QUERY_LEN

    query_lens = query_lens or seq_lens
    out, expected, starts = run_hopper(seq_lens, query_lens, num_kv_heads, group, head_dim, dtype,
                                       seed=len(seq_lens), programs=programs)
    for start, end in zip(starts, starts[1:]):
        if end - start >= MIN_QUERY_LEN:
            assert_close(out[start:end], expected[start:end], dtype)
        else:   # the Triton kernel's rows: untouched
            assert out[start:end].isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_H100, reason="needs an sm_90 GPU")
def test_mixed_steps_replay_from_one_graph_padded_like_the_runners():
    """One capture (every sequence padding, as the runner captures), replayed for fresh prompts, chunks
    after a prefix beside decode rows, and verification rows: the plan is rebuilt inside the graph."""
    from minivllm.attention.metadata import AttentionMetadata
    from minivllm.attention.triton_backend import TritonAttentionBackend

    max_seqs, num_tokens, num_blocks, width = 32, 1024, 1100, 160
    dtype = torch.bfloat16
    query = torch.zeros(num_tokens, 32, 128, dtype=dtype, device="cuda")
    key, value = (torch.zeros(num_tokens, 8, 128, dtype=dtype, device="cuda") for _ in range(2))
    k_cache, v_cache = (torch.zeros(num_blocks, 16, 8, 128, dtype=dtype, device="cuda") for _ in range(2))
    metadata = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.zeros(max_seqs + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.zeros(max_seqs, dtype=torch.int32, device="cuda"),
        block_tables=torch.zeros(max_seqs, width, dtype=torch.int32, device="cuda"),
        max_query_len=num_tokens, max_seq_len=width * 16)
    backend = TritonAttentionBackend()

    def attend():
        return backend.attend(query, k_cache, v_cache, metadata, 128 ** -0.5, key=key, value=value)
    attend()
    torch.cuda.synchronize()
    metadata.backend_state.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    steps = [([512] * 2, [512] * 2), ([700, 2001, 300, 40, 9], [64, 1, 300, 40, 6]),
             ([2048] * 8, [6] * 8), ([1500, 90], [900, 90])]
    for seed, (seq_lens, query_lens) in enumerate(steps):
        q, k, v, kc, vc, step = make_batch(seq_lens, query_lens, 8, 4, 128, dtype, seed=seed)
        write_kv_reference(k, v, kc, vc, step.slot_mapping)
        rows, seqs = q.shape[0], len(seq_lens)
        for static, x in ((query, q), (key, k), (value, v)):
            static[:rows] = x
        k_cache[:kc.shape[0]], v_cache[:vc.shape[0]] = kc, vc
        metadata.query_start_loc[:seqs + 1] = step.query_start_loc
        metadata.query_start_loc[seqs + 1:] = rows
        metadata.seq_lens.zero_()
        metadata.seq_lens[:seqs] = step.seq_lens
        metadata.block_tables[:seqs, :step.block_tables.shape[1]] = step.block_tables
        graph.replay()
        expected = paged_attention_reference(q, kc, vc, step.query_start_loc_cpu, seq_lens, step.block_tables,
                                             128 ** -0.5)
        assert_close(out[:rows], expected, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_H100, reason="needs an sm_90 GPU")
def test_engine_prompt_logprobs_through_the_hopper_kernel_match_the_triton_kernel(tmp_path, monkeypatch):
    """bf16 with head_dim 128, the kernel's shapes, through the real model's q/k/v views: prompts that are
    chunked (later chunks read a cached prefix), a prefix-cache hit, steps eager (larger than the graphs
    take) and replayed, all score every prompt token as the Triton kernel alone does."""
    from minivllm.kernels import prefill_attention_sm90 as sm90

    make_tiny_hf_checkpoint(tmp_path, "llama3", hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=128, intermediate_size=256)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 128, (96,), generator=g).tolist()
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 130, 251)] + [shared + [7] * 70]
    hit = shared + [9] * 90   # its first 96 tokens' blocks are cached by then: a 90-row chunk after them

    def prompt_logprobs():
        llm = LLM(model=str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
                  max_model_len=256, max_num_batched_tokens=192, max_num_seqs=8, cuda_graph_max_tokens=128,
                  enable_prefix_caching=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        values = [lp.logprob for o in outputs for entry in o.prompt_logprobs[1:] for lp in entry.values()]
        # (Prompt logprobs bypass the prefix cache, so the hit is scored by its first token's top 5.)
        output, = llm.generate([{"prompt_token_ids": hit}], SamplingParams(temperature=0.0, max_tokens=1,
                                                                            logprobs=5), use_tqdm=False)
        assert output.num_cached_tokens == 96
        values += sorted(lp.logprob for lp in output.outputs[0].logprobs[0].values())
        del llm
        torch.cuda.empty_cache()
        return torch.tensor(values)

    calls = []
    real = sm90.prefill_attention
    monkeypatch.setattr(sm90, "prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    hopper = prompt_logprobs()
    assert calls
    monkeypatch.setattr(sm90, "supported", lambda *a: False)
    triton_kernel = prompt_logprobs()
    assert len(hopper) == sum(len(p) - 1 for p in prompts) + 5
    torch.testing.assert_close(hopper, triton_kernel, atol=0.05, rtol=0.02)
