"""Suffix decoding proposer (after SuffixDecoding, Oliaro et al. 2024): drafts from a sequence's own
prompt + output and from a bounded cache of other requests' recent outputs, as long as their frequency
says the continuation is likely.

A draft starts at the longest suffix of the sequence that was seen before followed by some token, then
follows the most frequent continuation while the product of the continuation frequencies (the chance that
the whole draft so far is right) stays at least `min_token_prob`, for at most `max_spec_factor` x the
match length tokens (a long match predicts far). The own history and the cache each propose a draft (the
cache only after a match of at least `min_cache_match` tokens); the one with the larger score (the sum of
those products: the expected number of accepted tokens) wins, the own history on a tie. A match in the own
history is at most `max_depth` - 1 tokens and its draft is not bounded by the depth: a sequence that copies a
passage keeps matching `max_depth` - 1 tokens and must still draft k. The cache's paths are `max_depth` tokens
deep, so its match leaves room for the draft (at most `max_depth` - k tokens, less the stand-ins).

- The own history is the controller's int32 `array` of the sequence, searched like the n-gram proposer's
  with `bytes.rfind` (the longest match by bisection, then its `MAX_OCCURRENCES` latest occurrences):
  nothing is kept up to date per token, so a sequence that does not speculate costs nothing.
- `SuffixCache` is a trie of every substring of up to `max_depth` tokens of the last `max_cached_requests`
  outputs: per node the occurrences of its string, how many of them a further token follows, and its
  most frequent child, so a lookup costs a walk of dict lookups whatever the cache holds. An output costs
  `max_depth` node visits per token to insert, so finished outputs queue and `work` inserts them in slices
  of time after a step is launched; once the cache is full the oldest output is removed the same way. A
  node is an index into flat lists of ints and a dict of int to int (which the garbage collector does not
  track), not an object: millions of nodes add nothing to a collection's walk.
"""
from __future__ import annotations

import time
from array import array
from collections import deque

from minivllm.spec_decode.ngram import ITEM, token_history

# Latest occurrences of the match in a sequence's own history that vote on a draft; each costs the host a
# search, and the latest few carry the continuation (the lookup's cost: `us_per_proposal` in spec_replay's file).
MAX_OCCURRENCES = 8
ROOT = 0


def greedy_continuation(continuations: list, limit: int, min_token_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent next token among `continuations` (token sequences that followed the match,
    latest first: ties go to the latest) while the running product of frequencies is at least
    `min_token_prob`; returns the draft and its score (the sum of the products)."""
    draft, prob, score = [], 1.0, 0.0
    survivors = continuations
    for j in range(limit):
        first = survivors[0] if survivors else ()
        if all(c == first for c in survivors):   # one continuation left (the usual case): the rest of it
            rest = first[j:limit]
            draft.extend(rest)
            return draft, score + prob * len(rest)
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
    return draft, score


class SuffixCache:
    """Substring counts of recent outputs, bounded by `max_cached_requests` outputs of `max_depth`-deep paths."""

    def __init__(self, max_depth: int, max_cached_requests: int) -> None:
        self.max_depth, self.max_cached_requests = max_depth, max_cached_requests
        self._occurrences = [0]        # node -> occurrences of its string (at most max_depth tokens deep)
        self._followed = [0]           # node -> those followed by a token within the depth (sum over children)
        self._best = [-1]              # node -> its child with the most occurrences
        self._token = [-1]             # node -> the token on the edge into it
        self._children: list[dict | None] = [None]   # node -> {token: child}
        self._free: list[int] = []
        self._cached: deque[array] = deque()          # outputs in the trie, oldest first
        self._ops: deque[list] = deque()              # [tokens, next start position, +1 insert / -1 remove]

    @property
    def num_nodes(self) -> int:
        return len(self._token) - len(self._free)

    @property
    def has_work(self) -> bool:
        return bool(self._ops)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def add(self, tokens) -> None:
        """Queue an output for insertion (`work` inserts it); beyond the cache's size the oldest queued
        one is dropped, so the queue stays bounded when outputs arrive faster than `work` runs."""
        if len(tokens) < 2:
            return
        self._ops.append([token_history(tokens), 0, 1])
        queued = [op for op in self._ops if op[2] > 0 and op[1] == 0]
        if len(queued) > self.max_cached_requests:
            self._ops.remove(queued[0])

    def work(self, seconds: float) -> bool:
        """Insert and remove queued outputs for about `seconds` of host time; returns whether work is left."""
        deadline = time.perf_counter() + seconds
        while self._ops:
            op = self._ops[0]
            tokens, sign = op[0], op[2]
            n = len(tokens)
            while op[1] < n:
                self._update_suffix(tokens, op[1], sign)
                op[1] += 1
                if op[1] % 4 == 0 and time.perf_counter() > deadline:
                    return True
            self._ops.popleft()
            if sign > 0:
                self._cached.append(tokens)
                while len(self._cached) > self.max_cached_requests:   # removed before the next insert
                    self._ops.appendleft([self._cached.popleft(), 0, -1])
        return False

    def _new_node(self, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self._occurrences[node] = self._followed[node] = 0
            self._best[node], self._token[node], self._children[node] = -1, token, None
            return node
        self._occurrences.append(0)
        self._followed.append(0)
        self._best.append(-1)
        self._token.append(token)
        self._children.append(None)
        return len(self._token) - 1

    def _update_suffix(self, tokens, start: int, sign: int) -> None:
        """Add (sign 1) or remove (-1) the path of tokens[start : start + max_depth]."""
        occurrences, followed, best, children_of = self._occurrences, self._followed, self._best, self._children
        node, path = ROOT, []
        for token in tokens[start:start + self.max_depth]:
            children = children_of[node]
            if children is None:
                children = children_of[node] = {}
            child = children.get(token)
            if child is None:   # (only when inserting)
                child = children[token] = self._new_node(token)
            followed[node] += sign
            occurrences[child] += sign
            if sign > 0:
                if best[node] < 0 or occurrences[child] >= occurrences[best[node]]:
                    best[node] = child
            else:
                path.append((node, child))
            node = child
        for parent, child in reversed(path):   # deepest first: a string that no longer occurs goes
            if occurrences[child] == 0:
                del children_of[parent][self._token[child]]
                self._free.append(child)
            if best[parent] == child:
                children = children_of[parent]
                best[parent] = max(children.values(), key=occurrences.__getitem__) if children else -1

    def _walk(self, pattern) -> int:
        node = ROOT
        for token in pattern:
            children = self._children[node]
            node = children.get(token, -1) if children is not None else -1
            if node < 0:
                return -1
        return node

    def match(self, history) -> tuple[int, int]:
        """The node of the longest suffix of `history` (at most max_depth - 1 tokens) that the cache has
        seen followed by a token, and its length; (ROOT, 0) when none. Bisection: a suffix of such a
        string is such a string too."""
        low, high, found = 0, min(self.max_depth - 1, len(history)), ROOT
        n = len(history)
        while low < high:
            mid = (low + high + 1) // 2
            node = self._walk(history[n - mid:])
            if node >= 0 and self._followed[node]:
                low, found = mid, node
            else:
                high = mid - 1
        return found, low

    def draft(self, node: int, limit: int, min_token_prob: float) -> tuple[list[int], float]:
        """The most frequent path below `node`, as `greedy_continuation` takes it."""
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < limit and self._followed[node]:
            child = self._best[node]
            prob *= self._occurrences[child] / self._followed[node]
            if prob < min_token_prob:
                break
            draft.append(self._token[child])
            score += prob
            node = child
        return draft, score


class SuffixProposer:
    proposes_on_device = False

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 512, max_spec_factor: float = 2.0,
                 min_token_prob: float = 0.3, min_cache_match: int = 3) -> None:
        self.max_depth, self.max_spec_factor, self.min_token_prob = max_depth, max_spec_factor, min_token_prob
        self.min_cache_match = min_cache_match
        self.cache = SuffixCache(max_depth, max_cached_requests)

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
        own, own_score = self.propose_own(history, k, skip)
        if own_score >= k + skip:   # certain, and as long as any draft: the cache cannot score higher
            return own[skip:]
        room = max(1, self.max_depth - k - skip)   # the longest match whose path leaves k + skip tokens below it
        node, match_len = self.cache.match(history[max(0, len(history) - room):])
        if match_len >= max(1, self.min_cache_match):
            limit = min(self._limit(match_len, k, skip), self.max_depth - match_len)
            other, score = self.cache.draft(node, limit, self.min_token_prob)
            if score > own_score and len(other) > skip:
                return other[skip:]
        return own[skip:]

    def propose_own(self, history: array, k: int, skip: int = 0) -> tuple[list[int], float]:
        """The draft from the sequence's own tokens, and its score."""
        n = len(history)
        data = history.tobytes()
        end = ITEM * (n - 1)   # an occurrence must be followed by a token of the history

        def latest(match_len: int, before: int) -> int:
            tail, stop = data[ITEM * (n - match_len):], before
            while (at := data.rfind(tail, 0, stop)) >= 0:
                if at % ITEM == 0:
                    return at // ITEM
                stop = at + len(tail) - 1   # straddles tokens: look further back
            return -1

        low, high = 0, min(self.max_depth - 1, n - 1)
        while low < high:   # the longest suffix seen before (a suffix of a recurring string recurs)
            mid = (low + high + 1) // 2
            if latest(mid, end) >= 0:
                low = mid
            else:
                high = mid - 1
        if low == 0:
            return [], 0.0
        limit = self._limit(low, k, skip)
        continuations, stop = [], end
        while len(continuations) < MAX_OCCURRENCES and (at := latest(low, stop)) >= 0:
            continuations.append(history[at + low:min(n, at + low + limit)])
            stop = ITEM * (at + low) - 1
        return greedy_continuation(continuations, limit, self.min_token_prob)

    def add_output(self, output_token_ids) -> None:
        self.cache.add(output_token_ids)

    def work(self, seconds: float) -> bool:
        return self.cache.work(seconds)
