"""Suffix decoding and the per-sequence controller: proposals against a brute-force search over the same
texts, the cache's bounded memory, per-sequence draft plans, and an idle speculator that touches no
sequence."""
from __future__ import annotations

import numpy as np
import pytest

from minivllm import SamplingParams
from minivllm.core.sequence import SequenceGroup
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.controller import SpeculationController
from minivllm.spec_decode.ngram import NgramProposer, token_history
from minivllm.spec_decode.suffix import (MAX_CANDIDATES, MAX_OCCURRENCES, MIN_OWN_MATCH, SuffixCache, SuffixProposer,
                                         greedy_continuation)
from tests.test_spec_decode import _decoding_batch

DEPTH, FACTOR, MIN_PROB = 6, 1.0, 0.2


def _occurrences(corpus, pattern):
    """(sequence, start) of every occurrence of `pattern` followed by a token, latest sequence first."""
    m = len(pattern)
    return [(s, p) for s in reversed(corpus) for p in range(len(s) - m - 1, -1, -1) if s[p:p + m] == pattern]


def _brute_force(corpus, context, k, max_occurrences=None):
    """The longest suffix of `context` (at most DEPTH - 1 tokens) seen followed by a token, and for each draft
    position the counts of the next tokens among the occurrences that agree with the draft so far. Returns
    (match length, limit, continuations)."""
    length = 0
    for m in range(1, min(DEPTH - 1, len(context)) + 1):
        if _occurrences(corpus, context[len(context) - m:]):
            length = m
    if length < MIN_OWN_MATCH:
        return 0, 0, []
    occurrences = _occurrences(corpus, context[len(context) - length:])[:max_occurrences]
    limit = min(k, max(1, int(FACTOR * length)))
    return length, limit, [s[p + length:][:limit] for s, p in occurrences]


def _brute_force_cache(outputs, context, k, key_len):
    """The cache's answer by a scan of the outputs: of the latest MAX_CANDIDATES positions that follow the
    context's last `key_len` tokens (and precede a token), those matching the most tokens back (at most
    DEPTH - 1) vote. Returns (match length, limit, continuations), latest first."""
    if len(context) < key_len:
        return 0, 0, []
    key = context[len(context) - key_len:]
    candidates = [(out, p) for out in reversed(outputs) for p in range(len(out) - 1, key_len - 1, -1)
                  if out[p - key_len:p] == key][:MAX_CANDIDATES]
    if not candidates:
        return 0, 0, []

    def matched(out, p):
        return max(m for m in range(key_len, min(DEPTH - 1, len(context), p) + 1)
                   if out[p - m:p] == context[len(context) - m:])
    length = max(matched(out, p) for out, p in candidates)
    limit = min(k, max(1, int(FACTOR * length)))
    return length, limit, [out[p:p + limit] for out, p in candidates if matched(out, p) == length]


def _check_greedy(draft, score, continuations, limit, tie_to_latest, min_prob=MIN_PROB):
    """`draft` follows a most frequent continuation at each position (the latest occurrence's token on a
    tie when `tie_to_latest`), stops where the running product falls below MIN_PROB, and `score` sums it."""
    prob, expected_score, survivors = 1.0, 0.0, continuations
    for j in range(limit + 1):
        counts = {}
        for c in survivors:
            if len(c) > j:
                counts[c[j]] = counts.get(c[j], 0) + 1
        top = max(counts.values(), default=0)
        if j == limit or not counts or prob * top / sum(counts.values()) < min_prob:
            assert len(draft) == j, (draft, continuations)
            break
        assert counts.get(draft[j]) == top, (draft, continuations)
        if tie_to_latest:
            assert draft[j] == next(c[j] for c in survivors if len(c) > j and counts[c[j]] == top)
        prob *= top / sum(counts.values())
        expected_score += prob
        survivors = [c for c in survivors if len(c) > j and c[j] == draft[j]]
    assert score == pytest.approx(expected_score)


def test_suffix_proposals_match_a_brute_force_search():
    rng = np.random.default_rng(0)
    proposer = SuffixProposer(DEPTH, max_cached_requests=1000, max_spec_factor=FACTOR, min_token_prob=MIN_PROB)
    for i in range(1500):
        # Small alphabets (ids whose int32 bytes overlap when shifted, for the byte search) so texts repeat.
        alphabet = (np.arange(3), np.array([0, 1, 256, 65536]))[i % 2]
        history = rng.choice(alphabet, rng.integers(1, 60)).tolist()
        k = int(rng.integers(1, 8))
        own, match = proposer.propose_own(token_history(history), k)
        length, limit, continuations = _brute_force([history], history, k, MAX_OCCURRENCES)
        assert match == length
        _check_greedy(own, greedy_continuation(continuations, limit, 0.0)[1] if length else 0.0, continuations,
                      limit, tie_to_latest=True, min_prob=0.0)
    outputs = [rng.choice(np.arange(4), rng.integers(2, 30)).tolist() for _ in range(40)]
    for key_len in (1, 3):
        cache = SuffixCache(DEPTH, max_cached_requests=40, key_len=key_len)
        for output in outputs:
            cache.add(output)
        cached = [o for o in outputs if len(o) > key_len]
        for _ in range(500):
            context, k = rng.choice(np.arange(4), rng.integers(1, 12)).tolist(), int(rng.integers(1, DEPTH))
            draft, score, length = cache.propose(token_history(context),
                                                 lambda m, k=k: min(k, max(1, int(FACTOR * m))), MIN_PROB)
            expected_length, limit, continuations = _brute_force_cache(cached, context, k, key_len)
            assert length == expected_length
            if length:
                _check_greedy(draft, score, continuations, limit, tie_to_latest=True)
            else:
                assert draft == []
    # The proposer takes the draft of the longer match (its own history on a tie), the cache's only after a
    # match of at least `min_cache_match` tokens (the cache's key).
    used_cache = {1: 0, 3: 0}
    for min_cache_match in used_cache:
        proposer = SuffixProposer(DEPTH, max_cached_requests=40, max_spec_factor=FACTOR, min_token_prob=MIN_PROB,
                                  min_cache_match=min_cache_match)
        for output in outputs:
            proposer.add_output(output)
        cached = [o for o in outputs if len(o) > min_cache_match]
        for _ in range(200):
            history, k = rng.choice(np.arange(4), rng.integers(2, 20)).tolist(), int(rng.integers(1, DEPTH))
            own, own_match = proposer.propose_own(token_history(history), k)
            length, limit, continuations = _brute_force_cache(cached, history, k, min_cache_match)
            other = greedy_continuation(continuations, limit, MIN_PROB)[0] if length else []
            expected = other if length > own_match and other else own
            used_cache[min_cache_match] += expected is other and bool(other)
            assert proposer.propose(history, k) == expected
    assert all(used_cache.values())   # both settings took some drafts from the cache


def test_a_copied_passage_longer_than_the_depth_still_drafts_k_tokens():
    """A sequence that copies its prompt keeps matching DEPTH - 1 tokens of it: its own history still drafts k
    (a match is bounded by the depth, the draft is not), and so does the cache."""
    passage = list(range(100, 140))
    suffix = SuffixProposer(DEPTH, max_cached_requests=4, max_spec_factor=FACTOR, min_token_prob=MIN_PROB)
    for copied in range(DEPTH, 30):
        assert suffix.propose(passage + passage[:copied], 5) == passage[copied:copied + 5]
    suffix.add_output(passage)
    for copied in range(DEPTH, 30):
        draft, _, length = suffix.cache.propose(token_history(passage[:copied]), lambda m: 5, MIN_PROB)
        assert length == DEPTH - 1 and draft == passage[copied:copied + 5]


def test_the_cache_keeps_the_latest_outputs_and_frees_the_rest():
    """Bounded memory: with room for 5 outputs, the cache indexes and answers as one built from the last 5
    alone, and its token array stays within twice theirs; with room for none it holds nothing, and a
    lowered bound applies at the next insert."""
    rng = np.random.default_rng(1)
    outputs = [rng.choice(np.arange(5), 25).tolist() for _ in range(12)]
    bounded, fresh = SuffixCache(DEPTH, max_cached_requests=5), SuffixCache(DEPTH, max_cached_requests=5)
    for i, output in enumerate(outputs):
        bounded.add(output)
        if i >= 7:
            fresh.add(output)
        assert len(bounded._tokens) <= 2 * 26 * bounded.num_cached   # 25 tokens and a separator each
    assert bounded.num_cached == 5 and bounded.num_indexed == fresh.num_indexed == 5 * (25 - 3)
    for _ in range(300):
        context = token_history(rng.choice(np.arange(5), rng.integers(1, 8)).tolist())
        assert bounded.propose(context, lambda m: 4, MIN_PROB) == fresh.propose(context, lambda m: 4, MIN_PROB)
    empty = SuffixCache(DEPTH, max_cached_requests=0)
    empty.add(outputs[0])
    assert empty.num_indexed == 0 and empty.num_cached == 0
    bounded.max_cached_requests = 1   # a smaller bound applies at the next insert
    bounded.add(outputs[0])
    alone = SuffixCache(DEPTH, max_cached_requests=1)
    alone.add(outputs[0])
    assert bounded.num_cached == 1 and bounded.num_indexed == alone.num_indexed
    assert bounded.propose(token_history(outputs[0][:6]), lambda m: 4, MIN_PROB)[0] == outputs[0][6:10]
    bounded.clear()
    assert bounded.num_cached == bounded.num_indexed == 0


def test_proposals_behind_a_token_in_flight_skip_it_without_losing_drafts():
    """Under async scheduling a sequence's newest token is still being sampled when it proposes: the
    continuation's first token stands for it, and the drafts after it are as many as the match earns."""
    suffix = SuffixProposer(DEPTH, max_cached_requests=0, max_spec_factor=FACTOR, min_token_prob=MIN_PROB)
    history = [5, 6, 7, 8, 9, 5, 6]                   # "5 6" recurs once, followed by 7 8 9: a 2-token match
    assert suffix.propose(history, 3) == [7, 8]       # earns two drafts ...
    assert suffix.propose(history, 3, skip=1) == [8, 9]   # ... after the stand-in for the token in flight too
    assert suffix.propose([5, 7, 8, 9, 5], 3) == []   # a 1-token match drafts nothing (MIN_OWN_MATCH)
    assert suffix.propose([1, 2, 3, 9, 1, 2, 3], 2, skip=1) == [1, 2]   # a 3-token match earns 2 (k)
    rng = np.random.default_rng(1)
    ngram = NgramProposer(1, 3)
    for _ in range(300):
        tokens, k = rng.choice(np.arange(3), rng.integers(2, 30)).tolist(), int(rng.integers(1, 6))
        assert ngram.propose(tokens, k, skip=1) == ngram.propose(tokens, k + 1)[1:]


def test_suffix_config_and_cache_of_other_requests_outputs():
    config = SpeculativeConfig.from_dict({"method": "suffix"})
    assert config.num_speculative_tokens == 15 and config.suffix_decoding_max_tree_depth == 24
    for bad in ({"method": "suffix", "suffix_decoding_max_tree_depth": 1},
                {"method": "suffix", "suffix_decoding_min_token_prob": 2.0},
                {"method": "suffix", "suffix_decoding_min_cache_match": 0}):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_dict(bad)
    controller = SpeculationController(config, max_model_len=1024)
    answer = list(range(40, 60))
    controller.forget(7, [30, 31] + answer)          # another request's output
    seq = SequenceGroup("r", None, [1, 2, 40, 41], SamplingParams(max_tokens=100)).seqs[0]
    seq.append_token(42)
    seq.num_computed_tokens = 4
    assert controller.choose_k([seq]) == 15          # nothing measured: optimistic
    # a 3-token match earns 8 x 3 drafts (the draft factor): 15 (the cap) of the 17 tokens that followed it
    assert controller.propose([seq], 15) == 1 and seq.spec_token_ids == answer[3:18]


def test_only_sequences_whose_drafts_pay_for_their_verify_rows_speculate():
    """Per-sequence plans: at batch 8 where each extra row costs 5% of a plain step, the two sequences whose
    drafts are nearly always accepted speculate and the six whose drafts are rejected do not; at batch 1,
    where extra rows cost nothing, even a sequence with middling acceptance speculates."""
    controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                                       max_model_len=1024)
    seqs = _decoding_batch(8)
    for _ in range(30):
        for i, seq in enumerate(seqs):
            controller.observe_verification(seq, 4, 4 if i < 2 else 0)
            controller._count(seq, tried=True, proposed=True)
    for num_tokens in (8, 16, 32, 64):   # 1 ms a plain step of 8 tokens, +0.05 ms per token above
        controller.observe_step(num_tokens, 8, 0.001 + 0.00005 * (num_tokens - 8), speculative=False)
    controller.observe_step(16, 8, 0.0015, speculative=True)
    assert controller.choose_k(seqs) == 4
    assert controller.propose(seqs, 4) == 2
    assert [bool(s.spec_token_ids) for s in seqs] == [True, True] + [False] * 6
    lone = _decoding_batch(1)
    controller.observe_step(1, 1, 0.001, speculative=False)
    controller.observe_step(5, 1, 0.001, speculative=True)
    for _ in range(4):
        controller.observe_verification(lone[0], 4, 2)
    assert controller.choose_k(lone) > 0 and controller.propose(lone, 4) == 1


def test_an_idle_speculator_touches_no_sequence():
    """Under load with drafts that do not pay, a quiet step costs no estimate and `propose` clears only the
    sequences it gave drafts the step before: no per-sequence host work that a plain step does not do."""
    controller = SpeculationController(SpeculativeConfig(method="suffix"), max_model_len=1024)
    seqs = _decoding_batch(256)
    controller.observe_step(256, 256, 0.028, speculative=False)
    controller.observe_step(8192, 16, 0.600, speculative=False)
    calls = []
    cap = controller._cap
    controller._cap = lambda seq: calls.append(seq) or cap(seq)
    assert controller.choose_k(seqs) == 0 and len(calls) == 256   # one estimate over the batch
    seqs[3].spec_token_ids = [1]
    controller._drafted = [seqs[3]]
    calls.clear()
    for _ in range(7):   # QUIET_STEPS_LARGE_BATCH
        assert controller.choose_k(seqs) == 0 and controller.propose(seqs, 0) == 0
    assert calls == [] and seqs[3].spec_token_ids == []
