"""Tokenizer loading. Detokenization and chat formatting live elsewhere (engine/detokenizer, server).

A folder with a `tokenizer.json` (every folder minivllm writes, and nearly every HF checkpoint) loads as
`PreTrainedTokenizerFast`: the same `tokenizers` pipeline, special tokens and chat template AutoTokenizer
would give it, without importing transformers' Auto classes, which on some transformers releases pull in the
model and generation stacks (scikit-learn, torch._dynamo, sympy: seconds of a server's start). Other folders
(a sentencepiece model only) go through AutoTokenizer.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(tokenizer_dir: str | None) -> PreTrainedTokenizerBase | None:
    """The fast tokenizer saved in `tokenizer_dir` (with its chat template), or None without one. transformers is
    imported here, not with the engine: a start without a tokenizer (token-id prompts) never pays for it."""
    if tokenizer_dir is None:
        return None
    if (Path(tokenizer_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)
