"""Speculative decoding on the GPU: verify steps replay decode CUDA graphs one row per query token (the
mixed graphs and the varlen kernel for longer queries) and draft steps run the decode kernel; greedy
output equals plain decoding in fp32, on a tiny model and on the real one in the benchmark's setting."""
from __future__ import annotations

import gc

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.conftest import make_tiny_hf_checkpoint

pytestmark = pytest.mark.gpu

CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False},
    "draft_layers": {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 3, "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
}


def _repeating_prompts(tmp_path, seed: int, period: int, repeats: int, tails: tuple) -> list[dict]:
    """A tiny fp32 checkpoint in tmp_path, and prompts that repeat a random phrase (drafts to accept) before
    random tails of the given lengths."""
    make_tiny_hf_checkpoint(tmp_path, "llama3")
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, 128, (period,), generator=g).tolist()
    return [{"prompt_token_ids": phrase * repeats + torch.randint(3, 128, (n,), generator=g).tolist()} for n in tails]


TINY = dict(dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3, max_model_len=256)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_greedy_identical_with_speculation(name, tmp_path):
    prompts = _repeating_prompts(tmp_path, 2, 6, 5, (3, 17, 40))
    options, params = dict(TINY, max_num_seqs=8), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tmp_path), **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(tmp_path), speculative_config=CONFIGS[name], **options)
    assert llm.llm_engine.runner.graph_runner is not None
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert llm.llm_engine.get_stats().spec_decode.num_draft_tokens > 0
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


@pytest.mark.parametrize("name", ["ngram", "suffix"])
def test_verify_steps_of_every_sequence_replay_decode_graphs_past_max_num_seqs(name, tmp_path):
    """With max_num_seqs 2 and 4 drafts, a verify step of both sequences is 10 rows: the decode graphs reach 10
    rows (worker/cuda_graph.py, max_decode_rows), the step replays one, and greedy output equals plain decoding."""
    prompts = _repeating_prompts(tmp_path, 3, 5, 6, (4, 21, 33))
    options, params = dict(TINY, max_num_seqs=2), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tmp_path), **options)
    assert plain.llm_engine.runner.graph_runner.sizes[-1] == 2
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    llm = LLM(model=str(tmp_path), speculative_config=CONFIGS[name], **options)
    runner = llm.llm_engine.runner.graph_runner
    assert runner.sizes[-1] == 10 and runner.max_seqs == 2
    replayed = []
    for rows, graph in runner.graphs.items():
        graph.replay = (lambda original, rows: lambda: (replayed.append(rows), original())[1])(graph.replay, rows)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert max(replayed) > 2, "no verify step of both sequences replayed a decode graph"
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def _has_default_model() -> bool:
    from minivllm.models.loader import default_model_path
    try:
        return bool(default_model_path())
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _has_default_model(), reason="needs the default model's GGUF file")
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_real_model_fp32_greedy_identical_at_batch_1(method):
    """The speculation benchmark's setting (the real model, batch 1, its grounded prompts; adaptive n-gram
    with every verify step chained, so that chained and discarded steps both happen (priced on a machine's
    measured gaps, chaining may never pay there), suffix decoding on every step: the controller may switch
    suffix decoding off on this model, and then nothing would be verified) in fp32: every output equals plain
    decoding. In bf16 a few outputs part at near-ties, where a verify step's logits for a position differ in
    the last bits from a decode step's (WRITEUP.md section 5)."""
    from bench.spec_decode import NGRAM, SUFFIX, grounded_chats
    chats = [chat for _, chat in grounded_chats(6)]
    options = dict(dtype="float32", gpu_memory_utilization=0.3, max_model_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=192)
    plain = LLM(**options)
    reference = [plain.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids for chat in chats]
    batched_reference = [o.outputs[0].token_ids for o in plain.chat(chats, params, use_tqdm=False)]
    del plain
    llm = LLM(speculative_config=NGRAM if method == "ngram" else {**SUFFIX, "adaptive": False}, **options)
    if method == "ngram":
        llm.llm_engine.spec.chaining.chains = lambda seq_ids, plain_cost: True
    outputs = [llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids for chat in chats]
    assert outputs == reference
    assert [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)] == batched_reference
    stats = llm.llm_engine.get_stats().spec_decode
    assert stats.num_accepted_tokens > 100
    if method == "ngram":
        assert llm.llm_engine.spec.num_chained_steps > 0 and llm.llm_engine.scheduler.num_discarded_steps > 0


@pytest.mark.skipif(not _has_default_model(), reason="needs the default model's GGUF file")
def test_real_model_bf16_first_tokens_unchanged_by_speculation():
    """The compare part's grounded batch-1 case in bf16 (one engine, speculation switched per run, the KV cache as
    large as the GPU allows): a prompt's first token comes from its prefill, which speculation does not touch, so
    every output starts as plain decoding's. When a mixed graph's padding rows belonged to no sequence, the values
    that verify steps' graphs left in the shared memory pool reached two of these prompts' prefills as NaN, and
    their outputs were token 0 throughout (cuda_graph.py)."""
    from bench.spec_decode import NGRAM, grounded_chats
    chats = [chat for _, chat in grounded_chats(18)]
    params = SamplingParams(temperature=0.0, max_tokens=256)
    gc.collect()   # engines of earlier tests, in reference cycles: their memory would count against this one's cache
    torch.cuda.empty_cache()
    llm = LLM(seed=0, max_model_len=2048, max_num_seqs=1, speculative_config=NGRAM)
    engine = llm.llm_engine
    spec, engine.spec = engine.spec, None
    plain = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
    engine.spec = spec
    for _ in range(2):
        engine.block_manager.reset_prefix_cache()
        outputs = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
        assert [o[:1] for o in outputs] == [p[:1] for p in plain]
    assert engine.get_stats().spec_decode.num_accepted_tokens > 500
