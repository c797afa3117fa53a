"""Perplexity through the engine's prompt logprobs equals transformers' on the same windows."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_tiny_hf_checkpoint
from minivllm.engine.llm import LLM
from minivllm.engine.perplexity import perplexity, sliding_windows


def test_sliding_windows_score_every_token_once():
    windows = sliding_windows(1000, 256, 192)
    scored = [p for _, end, first in windows for p in range(first, end)]
    assert scored == list(range(1, 1000))
    assert all(end - start <= 256 for start, end, _ in windows)
    assert all(first - start >= 256 - 192 for start, _, first in windows[1:])   # context kept from overlap
    with pytest.raises(ValueError):
        sliding_windows(10, 4, 8)
    disjoint = sliding_windows(100, 25, 25)   # no overlap: each window's first token has no context
    assert [p for _, end, first in disjoint for p in range(first, end)] == [p for p in range(100) if p % 25]


def test_perplexity_matches_transformers(tmp_path):
    reference = make_tiny_hf_checkpoint(tmp_path, "llama3")
    ids = torch.randint(128, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, skip_tokenizer_init=True)
    ours = perplexity(llm, ids, window=64, stride=48, windows_per_batch=3)
    total = 0.0
    with torch.no_grad():
        for start, end, first in sliding_windows(len(ids), 64, 48):
            logprobs = torch.log_softmax(reference(torch.tensor([ids[start:end]])).logits[0].double(), -1)
            total -= sum(logprobs[p - start - 1, ids[p]].item() for p in range(first, end))
    assert ours["num_scored_tokens"] == len(ids) - 1
    assert ours["perplexity"] == pytest.approx(math.exp(total / (len(ids) - 1)), rel=1e-4)
