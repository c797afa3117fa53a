"""Tokenizer loading. Detokenization and chat formatting live elsewhere (engine/detokenizer, server)."""
from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(tokenizer_dir: str | None) -> PreTrainedTokenizerBase | None:
    """The fast tokenizer saved in `tokenizer_dir` (with its chat template), or None without one."""
    if tokenizer_dir is None:
        return None
    return AutoTokenizer.from_pretrained(tokenizer_dir)
