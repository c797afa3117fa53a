"""The engine on a GPU (Triton kernels, CUDA graphs) against transformers. Runs through the device tool:
`pytest -m gpu`; CI (no GPU) deselects these."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.conftest import make_tiny_hf_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CHATS = [
    "What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
    "How many legs does a spider have?", "Explain gravity in one sentence.",
]


def _hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
    return outs


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def test_fp32_tiny_model_token_identical(tmp_path):
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3").cuda()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              max_model_len=256)
    assert llm.llm_engine.runner.graph_runner is not None  # decode runs through CUDA graphs
    assert _greedy(llm, prompts, 40) == _hf_greedy(reference, prompts, 40)


def test_small_decode_graphs_compute_their_rows_logits(tmp_path):
    """Decode graphs of up to 16 rows return the logits of the rows they ran (what the LM head gives for
    the graph's hidden states), larger ones none; every decode step's inputs were staged straight into the
    graphs' buffers (padding rows included: 3 and 40 sequences replay the 4- and 48-row graphs); greedy output
    still equals transformers'."""
    from minivllm.worker.cuda_graph import LOGITS_IN_GRAPH_MAX_ROWS
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3").cuda()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in range(5, 45)]   # 40 sequences
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              max_model_len=256, max_num_seqs=48)
    runner = llm.llm_engine.runner
    graphs, seen, staged = runner.graph_runner, [], []
    run = graphs.run

    def checked(inputs):
        hidden, logits = run(inputs)
        if inputs.metadata.is_decode_only:
            rows = hidden.shape[0]
            seen.append((rows, logits is not None))
            staged.append(inputs.staged is not None and inputs.staged[0] is graphs)
            if logits is not None:
                torch.testing.assert_close(logits, runner.model.compute_logits(hidden), rtol=1e-5, atol=1e-5)
        return hidden, logits
    graphs.run = checked
    expected = _hf_greedy(reference, prompts, 12)
    assert _greedy(llm, prompts[:3], 12) == expected[:3]
    assert _greedy(llm, prompts, 12) == expected
    del graphs.run
    assert set(staged) == {True} and {rows for rows, _ in seen} >= {3, 40}
    assert {with_logits for rows, with_logits in seen if rows <= LOGITS_IN_GRAPH_MAX_ROWS} == {True}
    assert {with_logits for rows, with_logits in seen if rows > LOGITS_IN_GRAPH_MAX_ROWS} == {False}


def test_mixed_steps_replay_cuda_graphs_and_stay_token_identical(tmp_path):
    """Prompt chunks under a 96-token budget, decodes riding along with them, and prefix-cache hits all
    replay the mixed-step graphs (padded rows and sequences included); greedy output still equals
    transformers', fp32."""
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3").cuda()
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 128, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 29, 61)]
    prompts.append(torch.randint(3, 128, (150,), generator=g).tolist())
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=96)
    graphs = llm.llm_engine.runner.graph_runner
    mixed_replays = []
    run = graphs.run
    graphs.run = lambda inputs: mixed_replays.append(not inputs.metadata.is_decode_only) or run(inputs)
    expected = _hf_greedy(reference, prompts, 24)
    assert _greedy(llm, prompts, 24) == expected
    assert _greedy(llm, prompts, 24) == expected  # again, the shared prefix now read from the cache
    del graphs.run  # the counting wrapper refers back to the runner: drop it, or the engine outlives the test
    assert llm.llm_engine.block_manager.prefix_cache_hits > 0
    assert sum(mixed_replays) >= 4  # 363 prompt tokens under a 96-token budget take at least 4 steps


_FRESH_ENGINE = """
import json, sys
from minivllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
          max_model_len=256, max_num_seqs=8, max_num_batched_tokens=96)
prompts = json.loads(sys.argv[2])
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
graphs = llm.llm_engine.runner.graph_runner
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "warmed_up": graphs.warmed_up,
                  "mixed": graphs.mixed_sizes, "decode": graphs.sizes}))
"""


def test_graphs_captured_without_warm_up_with_an_empty_kernel_cache(tmp_path):
    """Graphs are captured without an eager warm-up pass (the kernels they use compiled and loaded during the
    capture, from an empty Triton cache in a fresh process), mixed and decode sizes alike; decodes, prompt
    chunks and decodes riding along with them replay them and stay token-identical to transformers, fp32."""
    reference = make_tiny_hf_checkpoint(tmp_path / "model", "llama3").cuda()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (4, 37, 130)]
    expected = _hf_greedy(reference, prompts, 24)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    del reference
    gc.collect()   # engines of earlier tests, in reference cycles: their memory would count against the child's
    torch.cuda.empty_cache()
    done = subprocess.run([sys.executable, "-c", _FRESH_ENGINE, str(tmp_path / "model"), json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == expected
    assert result["mixed"] and result["decode"]
    assert not set(result["warmed_up"]) & set(result["mixed"])   # no mixed size needed its warm-up
    assert len(result["warmed_up"]) <= 1   # at most batch 1's decode, whose one-row GEMV is timed at start


def test_mixed_graph_padding_rows_are_a_sequence_of_their_own(tmp_path):
    """Every row of a mixed graph belongs to a sequence: a 100-token prompt replays the 128-row graph, whose 28 padding
    rows are the next sequence, with no context (cuda_graph.py: a row no sequence owns keeps whatever the memory pool
    held as its attention output, NaN included, and the key tile at a chunk's end reads the rows after it); greedy
    output still equals transformers', fp32."""
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3").cuda()
    prompt = torch.randint(3, 128, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.2,
              max_model_len=256, max_num_seqs=2)
    graphs = llm.llm_engine.runner.graph_runner
    assert 128 in graphs.mixed_sizes and 100 not in graphs.mixed_sizes
    assert _greedy(llm, [prompt], 1) == _hf_greedy(reference, [prompt], 1)   # one step: the prompt's, a mixed graph
    assert graphs.query_start_loc.tolist() == [0, 100, 128, 128]
    assert graphs.mixed_in.seq_lens.tolist() == [100, 28, 0]


@pytest.fixture(scope="module")
def default_hf():
    from transformers import AutoModelForCausalLM

    from minivllm.models.loader import default_model_path
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).cuda().eval()


def _chat_prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for c in CHATS]


def test_fp32_default_model_token_identical(default_hf):
    llm = LLM(dtype="float32", gpu_memory_utilization=0.3, max_model_len=1024)
    prompts = _chat_prompts(llm)
    assert _greedy(llm, prompts, 32) == _hf_greedy(default_hf, prompts, 32)


def test_bf16_default_model_prefill_logits_within_bf16_tolerance(default_hf):
    llm = LLM(dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=1024)
    runner = llm.llm_engine.runner
    prompts = _chat_prompts(llm)
    captured = []
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h: captured.append(original(h).float()) or captured[-1]
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
    finally:
        runner.model.compute_logits = original
    ours = torch.cat(captured)
    with torch.inference_mode():
        ref = torch.stack([default_hf(torch.tensor([p], device="cuda")).logits[0, -1] for p in prompts])
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, f"relative error {rel:.3g}"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


def test_kv_cache_takes_the_memory_left_after_weights():
    util = 0.5
    llm = LLM(model="qwen3-0.6b", load_format="dummy", skip_tokenizer_init=True, gpu_memory_utilization=util,
              max_model_len=4096)
    runner = llm.llm_engine.runner
    total = torch.cuda.get_device_properties(0).total_memory
    allowed_after_weights = util * total - runner.weight_bytes
    assert runner.kv_cache_bytes >= 0.9 * allowed_after_weights
    assert runner.num_kv_tokens == runner.num_blocks * runner.block_size
