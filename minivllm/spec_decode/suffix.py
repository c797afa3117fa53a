"""Suffix decoding proposer (after SuffixDecoding, Oliaro et al. 2024): drafts from a sequence's own
prompt + output and from a bounded cache of other requests' recent outputs, as long as their frequency
says the continuation is likely.

A draft starts at the longest suffix of the sequence (at most `max_depth` - 1 tokens) that was seen before
followed by some token, and follows the most frequent continuation among that suffix's latest occurrences
(ties to the latest), for at most `max_spec_factor` x the match length tokens (a long match predicts far). In
the cache, whose counts span many requests, a draft also stops where the product of the continuation
frequencies (the chance that the whole draft so far is right) falls below `min_token_prob`; the own history's
few occurrences follow their majority as n-gram lookup follows the latest (with the floor too, suffix decoding
verified 71 times against n-gram's 87 on open-ended chat on an H200 and ran slower: `compare_own_floor` in
bench/results/spec_decode_h200.json). The own history and the cache each propose a draft (the cache only after a
match of at least `min_cache_match` tokens); the one with the longer match wins, the own history on a tie. A
sequence that copies a passage keeps matching `max_depth` - 1 tokens and still drafts k: the depth bounds the
match, not the draft.

- The own history is the controller's int32 `array` of the sequence, searched like the n-gram proposer's
  with `bytes.rfind` (the longest match by bisection, then its `MAX_OCCURRENCES` latest occurrences):
  nothing is kept up to date per token, so a sequence that does not speculate costs nothing.
- `SuffixCache` holds the last `max_cached_requests` outputs end to end in one int32 array and indexes
  every position by the `key_len` tokens before it. A lookup takes the latest `MAX_CANDIDATES` positions
  that follow the sequence's last `key_len` tokens, measures how far back each matches, and votes among
  the longest as the own history does, stopping at `min_token_prob`. Inserting an output costs one dict append
  per token, so outputs go in whole when their request finishes (a trie of every substring cost `max_depth`
  node updates per token, which on a batch-1 step of a small model, bound by the host, lengthened steps:
  WRITEUP section 5, tried and rejected).
"""
from __future__ import annotations

from array import array
from collections import deque

from minivllm.spec_decode.ngram import ITEM, latest_match, token_history

# Latest occurrences of the match in a sequence's own history that vote on a draft; each costs the host a
# search, and the latest few carry the continuation (the lookup's cost: `us_per_proposal` in spec_replay's file).
MAX_OCCURRENCES = 8
# Shortest match in the own history that drafts (as n-gram's `prompt_lookup_min`): after a one-token match the
# draft is rarely right, and each verify step costs more than a plain one (`suffix_own_match1` in spec_replay's file).
MIN_OWN_MATCH = 2
# Latest cache positions after the sequence's last `key_len` tokens whose match is measured (each costs a few
# slice comparisons); the voters are those of them with the longest match.
MAX_CANDIDATES = 16
SEPARATOR = -1   # after each cached output: no token id equals it, so matches and drafts stop there


def greedy_continuation(continuations: list, limit: int, min_token_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent next token among `continuations` (token sequences that followed the match,
    latest first: ties go to the latest) while the running product of frequencies is at least
    `min_token_prob`; returns the draft and its score (the sum of the products)."""
    draft, prob, score = [], 1.0, 0.0
    survivors = continuations
    j = 0
    while j < limit:
        first = survivors[0] if survivors else ()
        if all(c == first for c in survivors):   # one continuation left (the usual case): the rest of it
            rest = first[j:limit]
            draft.extend(rest)
            return draft, score + prob * len(rest)
        # Where every survivor has the same next token the vote is unanimous (prob unchanged, nobody drops out):
        # take those tokens without a count and a filter per position (zip stops at the shortest survivor).
        for column in zip(*(c[j:limit] for c in survivors)):
            if column.count(column[0]) != len(column):
                break
            draft.append(column[0])
            score += prob
            j += 1
        if j == limit:
            break
        counts: dict[int, int] = {}
        for c in survivors:
            if len(c) > j:
                counts[c[j]] = counts.get(c[j], 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.get)
        prob *= counts[token] / sum(counts.values())
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        survivors = [c for c in survivors if len(c) > j and c[j] == token]
        j += 1
    return draft, score


class SuffixCache:
    """Recent outputs of other requests, bounded by `max_cached_requests`, indexed by `key_len`-token strings."""

    def __init__(self, max_depth: int, max_cached_requests: int, key_len: int = 3) -> None:
        self.max_depth, self.max_cached_requests, self.key_len = max_depth, max_cached_requests, key_len
        self.clear()

    def clear(self) -> None:
        self._tokens = array("i")   # cached outputs, each followed by SEPARATOR; _tokens[0] is position _base
        self._base = 0
        self._outputs: deque[tuple[int, int]] = deque()   # (start, end) positions of each output, oldest first
        self._index: dict[bytes, list[int]] = {}          # key -> positions after its occurrences, ascending

    @property
    def num_cached(self) -> int:
        return len(self._outputs)

    @property
    def num_indexed(self) -> int:
        """Positions in the index (one per cached token after each output's first `key_len`)."""
        return sum(map(len, self._index.values()))

    def _keys(self, start: int, end: int) -> list[bytes]:
        """The key before each position from start + key_len to end - 1 (those followed by a token)."""
        data, key = self._tokens[start - self._base:end - self._base].tobytes(), ITEM * self.key_len
        return [data[at - key:at] for at in range(key, len(data), ITEM)]

    def add(self, tokens) -> None:
        """Cache an output; beyond `max_cached_requests` the oldest ones go."""
        if len(tokens) <= self.key_len or self.max_cached_requests <= 0:
            return
        start = self._base + len(self._tokens)
        self._tokens.extend(token_history(tokens))
        self._tokens.append(SEPARATOR)
        end = start + len(tokens)
        self._outputs.append((start, end))
        index = self._index
        for position, key in enumerate(self._keys(start, end), start + self.key_len):
            positions = index.get(key)
            if positions is None:
                index[key] = [position]
            else:
                positions.append(position)
        while len(self._outputs) > self.max_cached_requests:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest output: its positions are the first of each of its keys' lists."""
        start, end = self._outputs.popleft()
        index = self._index
        for key in self._keys(start, end):
            positions = index[key]
            del positions[0]
            if not positions:
                del index[key]
        dead = self._outputs[0][0] - self._base if self._outputs else len(self._tokens)
        if 2 * dead > len(self._tokens):   # keep the array at most twice what is cached
            del self._tokens[:dead]
            self._base += dead

    def propose(self, history: array, limit_of, min_token_prob: float) -> tuple[list[int], float, int]:
        """The draft continuing `history` from the cache, its score and the match length; `limit_of(match
        length)` gives the continuation tokens to follow."""
        n = len(history)
        if n < self.key_len:
            return [], 0.0, 0
        key = history[n - self.key_len:].tobytes()
        positions = self._index.get(key)
        if positions is None:
            return [], 0.0, 0
        tokens, base, longest = self._tokens, self._base, min(self.max_depth - 1, n)
        best, matched = self.key_len, []
        for position in positions[-MAX_CANDIDATES:][::-1]:   # latest first
            at = position - base
            if at < best or tokens[at - best:at] != history[n - best:]:
                continue   # matches less than the longest so far
            grown = best
            while grown < longest and at > grown and tokens[at - grown - 1] == history[n - grown - 1]:
                grown += 1   # (a SEPARATOR never equals a token: a match stays inside one output)
            if grown > best:
                best, matched = grown, []
            matched.append(at)
        limit = limit_of(best)
        continuations = []
        for at in matched:
            continuation = tokens[at:at + limit]
            if SEPARATOR in continuation:
                continuation = continuation[:continuation.index(SEPARATOR)]
            continuations.append(continuation)
        draft, score = greedy_continuation(continuations, limit, min_token_prob)
        return draft, score, best


class SuffixProposer:
    proposes_on_device = False

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 512, max_spec_factor: float = 2.0,
                 min_token_prob: float = 0.3, min_cache_match: int = 3, min_own_match: int = MIN_OWN_MATCH) -> None:
        self.max_depth, self.max_spec_factor, self.min_token_prob = max_depth, max_spec_factor, min_token_prob
        self.min_own_match = min_own_match
        self.cache = SuffixCache(max_depth, max_cached_requests, key_len=min_cache_match)   # a hit matches its key

    def _limit(self, match_len: int, k: int, skip: int = 0) -> int:
        """Continuation tokens to follow: `skip` stand-ins, then at most `k` drafts, as many as the match
        length allows (the stand-ins do not use up the drafts a match earns)."""
        return min(k, max(1, int(self.max_spec_factor * match_len))) + skip

    def propose(self, token_ids, k: int, skip: int = 0) -> list[int]:
        """Up to `k` draft tokens continuing `token_ids` (a list or a `token_history`) after its first `skip`
        continuation tokens (which stand for tokens still in flight)."""
        if k <= 0 or len(token_ids) < 2:
            return []
        history = token_history(token_ids)
        own, own_match = self.propose_own(history, k, skip)
        if self.cache.num_cached and own_match < self.max_depth - 1:   # (else no cache match is longer)
            other, _, match = self.cache.propose(history, lambda length: self._limit(length, k, skip),
                                                 self.min_token_prob)
            if match > own_match and len(other) > skip:
                return other[skip:]
        return own[skip:]

    def propose_own(self, history: array, k: int, skip: int = 0) -> tuple[list[int], int]:
        """The draft from the sequence's own tokens, and the length of its match (0: none)."""
        n = len(history)
        data = history.tobytes()
        end = ITEM * (n - 1)   # an occurrence must be followed by a token of the history
        low, high = self.min_own_match, min(self.max_depth - 1, n - 1)
        if low > high or latest_match(data, data[ITEM * (n - low):], end) < 0:   # (most steps of open-ended text)
            return [], 0
        while low < high:   # the longest suffix seen before (a suffix of a recurring string recurs)
            mid = (low + high + 1) // 2
            if latest_match(data, data[ITEM * (n - mid):], end) >= 0:
                low = mid
            else:
                high = mid - 1
        limit = self._limit(low, k, skip)
        tail = data[ITEM * (n - low):]
        continuations, stop = [], end
        while len(continuations) < MAX_OCCURRENCES and (at := latest_match(data, tail, stop)) >= 0:
            continuations.append(history[at + low:min(n, at + low + limit)])
            stop = ITEM * (at + low) - 1
        return greedy_continuation(continuations, limit, 0.0)[0], low

    def add_output(self, output_token_ids) -> None:
        self.cache.add(output_token_ids)
