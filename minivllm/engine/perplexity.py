"""Perplexity of a token stream through the engine's own prompt-logprobs path (what is served).

The text is scored in windows of `window` tokens starting every `stride` tokens; each window scores
only the tokens the previous one did not (all of them in the first window), so every token after
the first is scored once, with at least `window - stride` tokens of context (except near the start);
with stride == window (no overlap) each window's first token, which has no context, is skipped.
perplexity = exp(mean negative log-likelihood of the scored tokens).
"""
from __future__ import annotations

import math

from minivllm.sampling_params import SamplingParams


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) per window; positions are indices into the stream."""
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride {stride}, window {window}")
    windows, scored_until = [], 1   # token 0 has no context and is never scored
    start = 0
    while scored_until < num_tokens:
        end = min(start + window, num_tokens)
        # a window's first token has no context in it (stride == window: it stays unscored)
        windows.append((start, end, max(scored_until, start + 1)))
        scored_until = end
        start += stride
        if end == num_tokens:
            break
    return windows


def perplexity(llm, token_ids: list[int], window: int = 1024, stride: int = 512,
               windows_per_batch: int = 8) -> dict:
    """{"perplexity", "nll", "num_scored_tokens", "num_windows"} of `token_ids` under `llm`'s model."""
    spans = sliding_windows(len(token_ids), window, stride)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    total, count = 0.0, 0
    for i in range(0, len(spans), windows_per_batch):
        batch = spans[i:i + windows_per_batch]
        prompts = [{"prompt_token_ids": token_ids[start:end]} for start, end, _ in batch]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for (start, end, first), output in zip(batch, outputs):
            for position in range(first, end):
                entry = output.prompt_logprobs[position - start]
                total -= entry[token_ids[position]].logprob
                count += 1
    return {"perplexity": math.exp(total / count), "nll": total / count, "num_scored_tokens": count,
            "num_windows": len(spans)}
