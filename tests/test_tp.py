"""Tensor parallelism: two ranks (the driver and one worker process) against one process, on the CPU
(gloo) and, with the `gpu` marker, on GPUs (NCCL, CUDA graphs).

The reference is the same engine with tensor_parallel_size=1: greedy tokens must be identical on the
real default model in fp32, with batching and preemption (a KV pool too small for the batch), a
structured-output request and a prompt-logprobs request in the batch. A rank that raises, dies or
stalls must end in a clear error naming it within the deadline, never a hang; an idle group must
outlive the deadline.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.worker.executor import WorkerFailedError
from minivllm.distributed import attention_head_partition, split_evenly
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server.api_server import ServerThread, build_app
from tests.conftest import make_tiny_hf_checkpoint

PROMPTS = ["The capital of France is", "Write a short poem about the sea and the wind:", "1, 2, 3, 4,",
           "def fibonacci(n):", "Once upon a time, in a land far away,", "Q: What is 12 times 12?\nA:"]
# 8 blocks of 16 tokens cannot hold six sequences of ~40 tokens: the scheduler must preempt.
SMALL_POOL = dict(dtype="float32", num_gpu_blocks_override=8, max_model_len=128, max_num_seqs=6)


@pytest.mark.parametrize("heads,kv_heads,ranks", [(9, 3, 2), (32, 8, 2), (32, 8, 3), (8, 2, 4), (64, 8, 8),
                                                   (9, 3, 4), (9, 3, 5), (8, 2, 8)])
def test_head_partition_covers_every_head_once_with_its_kv_head(heads, kv_heads, ranks):
    group = heads // kv_heads
    seen = []
    for rank in range(ranks):
        q0, nq, kv0, nkv = attention_head_partition(heads, kv_heads, rank, ranks)
        assert nq > 0 and nkv > 0
        seen += range(q0, q0 + nq)
        assert nq % nkv == 0   # the kernels' mapping: local q head j reads local KV head j // (nq // nkv)
        assert all(kv0 + j // (nq // nkv) == (q0 + j) // group for j in range(nq))
    assert seen == list(range(heads))


def test_head_partition_rejects_splits_that_do_not_fit():
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        attention_head_partition(8, 2, 0, 3)   # rank 1's heads 3-5 read KV head 0 once and KV head 1 twice
    with pytest.raises(ValueError, match="tensor_parallel_size 4"):
        attention_head_partition(3, 1, 0, 4)   # more ranks than query heads


def test_split_evenly_tiles_the_range():
    parts = [split_evenly(10, 4, i) for i in range(4)]
    assert parts == [(0, 3), (3, 3), (6, 2), (8, 2)]


def _greedy(tp: int, **options) -> tuple[list[list[int]], int, list]:
    """Greedy tokens of PROMPTS (the second under a choice grammar), preemptions, the third's prompt
    logprobs."""
    llm = LLM(tensor_parallel_size=tp, **{**SMALL_POOL, **options})
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = [plain] * len(PROMPTS)
    params[1] = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["wind and waves", "salt and foam"]))
    params[2] = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    try:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outputs], llm.llm_engine.get_stats().num_preemptions,
                outputs[2].prompt_logprobs)
    finally:
        llm.llm_engine.shutdown()


def _assert_same_prompt_logprobs(ours, reference):
    assert ours[0] is None and reference[0] is None and len(ours) == len(reference) > 4
    for mine, theirs in zip(ours[1:], reference[1:]):
        assert list(mine) == list(theirs)   # the prompt token and the top 2, in order
        assert [v.logprob for v in mine.values()] == pytest.approx([v.logprob for v in theirs.values()], abs=1e-4)


@pytest.mark.long
def test_tp2_greedy_matches_tp1_under_batching_and_preemption():
    reference, ref_preemptions, ref_logprobs = _greedy(1)
    ours, preemptions, logprobs = _greedy(2)
    assert ref_preemptions > 0 and preemptions > 0
    assert ours == reference
    _assert_same_prompt_logprobs(logprobs, ref_logprobs)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_on_gpus_matches_tp1_on_the_default_model(tp):
    """NCCL and CUDA graphs: the real default model in fp32 gives TP = 1's greedy tokens (and prompt logprobs)
    at TP = 2 and 4, with preemption in the batch."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs, {torch.cuda.device_count()} visible")
    options = dict(device="cuda", gpu_memory_utilization=0.3)
    reference, _, ref_logprobs = _greedy(1, **options)
    ours, preemptions, logprobs = _greedy(tp, **options)
    assert preemptions > 0
    assert ours == reference
    _assert_same_prompt_logprobs(logprobs, ref_logprobs)


def _tiny_greedy(folder, tp: int, **options) -> tuple[list[list[int]], object, int]:
    """Greedy tokens, the runner and how many CUDA graphs it captured (read before shutdown drops them)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    llm = LLM(model=str(folder), dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=tp,
              max_model_len=256, **options)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        graphs = llm.llm_engine.runner.graph_runner
        return ([o.outputs[0].token_ids for o in outputs], llm.llm_engine.runner,
                0 if graphs is None else len(graphs.graphs))
    finally:
        llm.llm_engine.shutdown()


def test_tp4_replicates_kv_heads_split_across_ranks_like_tp1(tmp_path):
    """SmolLM2's head layout (9 query heads, 3 KV heads) at TP = 4: ranks hold 3, 2, 2, 2 query heads and one
    rank reads two KV heads, the others one (replicas of a KV head on two ranks)."""
    make_tiny_hf_checkpoint(tmp_path, "llama3", hidden_size=72, num_attention_heads=9, num_key_value_heads=3)
    options = dict(kv_cache_memory=4 << 20)
    assert _tiny_greedy(tmp_path, 4, **options)[0] == _tiny_greedy(tmp_path, 1, **options)[0]


def test_tp2_shards_biases_and_tied_embeddings_like_tp1(tmp_path):
    """q/k/v and MLP biases split with their rows, o_proj/down_proj biases added once after the
    all-reduce, the tied LM head sharded like the embedding (a tiny random checkpoint, every tensor
    random). Async scheduling on: the driver fills the tokens still in flight before broadcasting."""
    make_tiny_hf_checkpoint(tmp_path, "llama-tied-bias")
    options = dict(kv_cache_memory=4 << 20, async_scheduling=True)
    assert _tiny_greedy(tmp_path, 2, **options)[0] == _tiny_greedy(tmp_path, 1, **options)[0]


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_tp2_moe_shards_experts_like_tp1(tmp_path, arch):
    """Each rank holds half of every expert's intermediate rows (and Qwen2-MoE's shared expert is a
    sharded dense MLP): greedy tokens equal TP = 1's, and the stacked expert weights are half as wide."""
    make_tiny_hf_checkpoint(tmp_path, arch)
    options = dict(kv_cache_memory=4 << 20)
    ours, runner, _ = _tiny_greedy(tmp_path, 2, **options)
    reference, reference_runner, _ = _tiny_greedy(tmp_path, 1, **options)
    assert ours == reference
    widths = [m.w2_weight.shape[-1] for r in (runner, reference_runner) for m in r.model.modules()
              if type(m).__name__ == "FusedMoE"]
    assert widths and widths[0] * 2 == widths[-1]


def test_tp2_with_ngram_speculation_matches_tp1(tmp_path):
    """Verify steps (drafts in the broadcast input ids, k + 1 logits rows gathered) under TP = 2."""
    make_tiny_hf_checkpoint(tmp_path, "llama3")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    g = torch.Generator().manual_seed(3)
    phrase = torch.randint(3, 128, (5,), generator=g).tolist()
    prompts = [{"prompt_token_ids": phrase * 4 + torch.randint(3, 128, (n,), generator=g).tolist()} for n in (2, 9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for tp, config in ((1, None), (2, spec)):
        llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=tp,
                  max_model_len=256, kv_cache_memory=4 << 20, speculative_config=config)
        try:
            outputs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if config:
                assert llm.llm_engine.get_stats().spec_decode.num_accepted_tokens > 0
        finally:
            llm.llm_engine.shutdown()
    assert outputs[2] == outputs[1]


@pytest.mark.gpu
def test_tp2_on_two_gpus_with_cuda_graphs_and_async_scheduling(tmp_path):
    """NCCL, decode and mixed steps replayed from CUDA graphs holding the all-reduces, async scheduling
    on (the CUDA default): greedy tokens equal TP = 1's, fp32."""
    make_tiny_hf_checkpoint(tmp_path, "llama3")
    options = dict(gpu_memory_utilization=0.3, max_num_batched_tokens=96, max_num_seqs=8)
    ours, _, num_graphs = _tiny_greedy(tmp_path, 2, **options)
    assert num_graphs > 0
    assert ours == _tiny_greedy(tmp_path, 1, **options)[0]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fault,expected", [("exit", "rank 1 exited with code 3"),
                                            ("stall", "stalled: rank 1 (at step 2)")])
def test_a_dead_or_stalled_rank_fails_the_step_within_the_deadline(tmp_path, monkeypatch, device, fault,
                                                                    expected):
    """The worker dies (its process exits) or stops answering (alive, no progress) at its 3rd step: the
    driver's step raises an error naming rank 1 within the deadline plus the watchdog's tick, and the
    engine then shuts down without waiting for the lost rank. On GPUs the stalled step is inside a CUDA
    graph, where NCCL's own timeouts do not reach."""
    make_tiny_hf_checkpoint(tmp_path, "llama3")
    monkeypatch.setenv("MINIVLLM_TP_INJECT_FAULT", f"{fault}:3")
    options = dict(gpu_memory_utilization=0.3) if device == "cuda" else dict(kv_cache_memory=4 << 20)
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
              max_model_len=256, device=device, distributed_timeout_s=10, **options)
    started = time.monotonic()
    try:
        with pytest.raises(WorkerFailedError, match=re.escape(expected)):
            llm.generate([{"prompt_token_ids": list(range(3, 40))}],
                         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - started < 10 + 10
    finally:
        stopping = time.monotonic()
        llm.llm_engine.shutdown()
        assert time.monotonic() - stopping < 15


def test_an_idle_group_outlives_the_deadline(tmp_path):
    """Workers wait for the next step with a deadline; the idle driver's pings keep them waiting."""
    make_tiny_hf_checkpoint(tmp_path, "llama3")
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
              max_model_len=256, kv_cache_memory=4 << 20, distributed_timeout_s=3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        first = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        time.sleep(7)
        again = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    finally:
        llm.llm_engine.shutdown()


def test_worker_fault_during_a_step_fails_requests_and_health(monkeypatch):
    monkeypatch.setenv("MINIVLLM_TP_INJECT_FAULT", "raise:3")  # read by the worker process
    engine = AsyncEngine.from_config(EngineConfig(tensor_parallel_size=2, dtype="float32", max_model_len=256,
                                                  kv_cache_memory=16 << 20))
    with ServerThread(build_app(engine, served_model_name="smol")) as url:
        assert httpx.get(url + "/health").status_code == 200
        started = time.monotonic()
        response = httpx.post(url + "/v1/completions", timeout=120,
                              json={"model": "smol", "prompt": "Hello", "max_tokens": 16, "temperature": 0})
        assert time.monotonic() - started < 60   # an error, not a wait for the collective timeout
        assert response.status_code == 503, response.text
        assert "rank 1" in response.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
        again = httpx.post(url + "/v1/completions", timeout=30, json={"model": "smol", "prompt": "Hi", "max_tokens": 1})
        assert again.status_code == 503


@pytest.mark.long
def test_torchrun_two_nodes_on_localhost_match_one_process():
    """`torchrun --nnodes 2 --nproc-per-node 1` with c10d rendezvous, both "nodes" on this host (gloo):
    the rank torchrun made 0 runs the engine and prints the text, the other serves its steps and exits 0;
    the text equals a single process's."""
    from minivllm.worker.executor import _free_port
    command = ["generate", "The capital of France is", "--dtype", "float32", "--max-tokens", "12",
               "--kv-cache-memory", "64MiB"]
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "minivllm-test",
                               "-m", "minivllm.cli", *command, "--tensor-parallel-size", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0]
    single = subprocess.run([sys.executable, "-m", "minivllm.cli", *command], capture_output=True, text=True,
                            timeout=240, check=True).stdout
    assert single.strip()
    assert sorted(outputs) == sorted(["", single])
