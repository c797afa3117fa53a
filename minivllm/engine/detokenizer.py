"""Incremental detokenization of one sequence: new token ids -> a text delta, plus stop-string matching.

Owns the sequence's output text and the part of it already shown to the client. It must not touch the
sequence or the scheduler: the engine feeds token ids in and acts on the stop string it gets back.

Decoding uses `tokenizers`' DecodeStream, which re-decodes only the tokens since the last emitted piece
(O(1) amortised per token) and holds back bytes that do not yet form a whole UTF-8 character. Text that
might be the beginning of a stop string is held back too, so streamed deltas never contain any part of
a stop string that ends up cutting the output.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from minivllm.sampling_params import SamplingParams

# DecodeStream raises a plain Exception with this message when re-decoding changes already emitted text.
_INVALID_PREFIX = "Invalid prefix encountered"
# Prompt tokens fed to the stream before the output, so the first output token decodes as it would
# in the middle of the text (e.g. a SentencePiece word-start keeps its space).
_MIN_PROMPT_CONTEXT, _MAX_PROMPT_CONTEXT = 4, 24


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(tokenizer).__name__} has no `tokenizers` backend; "
                             "incremental detokenization needs a fast tokenizer")
        self._backend = backend
        self._skip_special_tokens = params.skip_special_tokens
        self._stop: list[str] = list(params.stop or [])
        self._include_stop_str = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._text = ""         # decoded output text, cut at the stop string once one matched
        self._num_visible = 0   # leading characters of _text already returned as deltas
        self._num_output_tokens = 0
        self._finished = False
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        for token_id in self._prompt_context(prompt_token_ids):
            self._step(token_id)

    @property
    def output_text(self) -> str:
        """The output text made visible so far (the concatenation of all deltas returned)."""
        return self._text[:self._num_visible]

    @property
    def finished(self) -> bool:
        return self._finished

    def update(self, new_token_ids: list[int], finished: bool = False) -> tuple[str, str | None]:
        """Append output token ids; return (newly visible text, matched stop string or None).

        Pass `finished=True` when the sequence ends for another reason (eos, stop token, length) so
        the text held back for a possible stop string is released. A matched stop string finishes too.
        """
        assert not self._finished, "update() after the sequence finished"
        check_from = len(self._text)  # stop strings are searched in text that ends after this offset
        for token_id in new_token_ids:
            piece = self._step(token_id)
            if piece:
                self._text += piece
            self._num_output_tokens += 1
            if self._num_output_tokens <= self._min_tokens:
                # As in vLLM: no stop string may end inside the first min_tokens tokens.
                check_from = len(self._text)

        stop_string = None
        if self._stop and self._num_output_tokens > self._min_tokens and len(self._text) > check_from:
            stop_string = self._cut_at_stop_string(check_from)
        self._finished = finished or stop_string is not None

        visible_end = len(self._text)
        if not self._finished and self._stop and not self._include_stop_str:
            visible_end -= self._partial_stop_length()
        visible_end = max(visible_end, self._num_visible)
        delta = self._text[self._num_visible:visible_end]
        self._num_visible = visible_end
        return delta, stop_string

    def decode_token(self, token_id: int) -> str:
        """One token's own text (special tokens included), as vLLM reports it in logprobs."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    # ---- internals ----------------------------------------------------------------------------------------
    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as error:
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            # Rare tokens whose decoding depends on what follows break the stream's invariant; restart
            # it from this token (the bytes it was still holding are lost, as in vLLM).
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, token_id)

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The shortest prompt suffix (of at least a few tokens) that decodes to whole characters."""
        if len(prompt_token_ids) <= _MIN_PROMPT_CONTEXT:
            return list(prompt_token_ids)
        for length in range(_MIN_PROMPT_CONTEXT, min(len(prompt_token_ids), _MAX_PROMPT_CONTEXT) + 1):
            suffix = prompt_token_ids[-length:]
            if "\ufffd" not in self._backend.decode(suffix, skip_special_tokens=self._skip_special_tokens):
                return suffix
        return []

    def _cut_at_stop_string(self, check_from: int) -> str | None:
        """Find the earliest stop string ending after `check_from`; cut the text there and return it."""
        best_start, best = len(self._text), None
        for stop in self._stop:
            start = self._text.find(stop, max(0, check_from - len(stop) + 1))
            if 0 <= start < best_start:
                best_start, best = start, stop
        if best is None:
            return None
        end = best_start + len(best) if self._include_stop_str else best_start
        # Held-back text covers every possible stop-string start, so nothing visible is ever cut.
        assert end >= self._num_visible
        self._text = self._text[:end]
        return best

    def _partial_stop_length(self) -> int:
        """Length of the longest end of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
