"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) compiled with xgrammar, one matcher per
sequence, and the per-step token bitmask the sampler applies. Engine-level: it owns the tokenizer."""
from minivllm.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
