"""SpeculativeConfig: vLLM's `speculative_config` dict, validated once.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}
    {"method": "draft_model", "draft_layers": N, "num_speculative_tokens": 4}   # the target's first N layers
    {"method": "suffix", "num_speculative_tokens": 15, "suffix_decoding_max_tree_depth": 24, ...}

Suffix decoding's keys are vLLM's. The default draft cap of n-gram and suffix decoding is 15 (a draft model's:
5, one draft pass per token): 15 drafts keep a batch-1 verify step in the 16-row decode graph that also computes
the logits, and the adaptive controller gives each sequence only the drafts its acceptance pays for. On an H200
with the real model, n-gram with up to 15 drafts beat 5 on grounded, open-ended and repetitive chat at batch 1 on
both machine starts measured; at batch 8 and 32 neither cap led on both (bench/results/spec_decode_h200.json,
`ngram_k5` in each compare case).
Suffix decoding's drafts also stop where their frequency says they are unlikely. Its draft factor and probability floor
default to 8 and 0.7 (vLLM's: 1 and 0.1): a match of two tokens may draft 15, and a draft stops where earlier
continuations disagree. The grid behind these defaults, replayed over the real model's greedy outputs on an H200
(bench/spec_replay.py), is in docs/speculative_decoding.md.

`adaptive` (minivllm's own, default on) lets the engine pick k per step, down to 0, from measured
acceptance and step cost; off, every eligible sequence speculates `num_speculative_tokens` each step.
"""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "suffix")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int | None = None   # 15 (draft_model: 5)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None          # draft_model: a folder, .gguf or dummy config name
    draft_layers: int | None = None   # draft_model: the target's first N layers (self-speculation)
    adaptive: bool = True
    suffix_decoding_max_tree_depth: int = 24           # a match is at most this minus one tokens
    suffix_decoding_max_cached_requests: int = 512     # other requests' outputs kept for lookups
    suffix_decoding_max_spec_factor: float = 8.0       # drafts per token of match
    suffix_decoding_min_token_prob: float = 0.7        # stop when the draft's estimated chance falls below
    suffix_decoding_min_cache_match: int = 3           # shortest match in other requests' outputs that drafts

    @classmethod
    def from_dict(cls, value: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            value = {**value, "method": "draft_model" if value.get("model") or value.get("draft_layers") else "ngram"}
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method == "draft":   # vLLM's older name
            self.method = "draft_model"
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 5 if self.method == "draft_model" else 15
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError("ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        elif self.method == "suffix":
            if self.suffix_decoding_max_tree_depth < 2 or self.suffix_decoding_max_cached_requests < 0:
                raise ValueError("suffix decoding needs suffix_decoding_max_tree_depth >= 2 and "
                                 "suffix_decoding_max_cached_requests >= 0")
            if self.suffix_decoding_max_spec_factor <= 0 or not 0 <= self.suffix_decoding_min_token_prob <= 1:
                raise ValueError("suffix decoding needs suffix_decoding_max_spec_factor > 0 and "
                                 "suffix_decoding_min_token_prob in [0, 1]")
            if self.suffix_decoding_min_cache_match < 1:
                raise ValueError("suffix decoding needs suffix_decoding_min_cache_match >= 1, got "
                                 f"{self.suffix_decoding_min_cache_match}")
        elif (self.model is None) == (self.draft_layers is None):
            raise ValueError("draft_model needs exactly one of 'model' (a draft checkpoint) or 'draft_layers' "
                             "(the target's first N layers)")
        elif self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"draft_layers must be at least 1, got {self.draft_layers}")

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"
