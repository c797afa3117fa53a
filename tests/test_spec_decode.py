"""Speculative decoding: proposers, exact verification, KV rollback, adaptive k — against the engine
without speculation (greedy: identical tokens; sampling: the same distribution)."""
from __future__ import annotations

import math
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.block_manager import BlockManager
from minivllm.core.interfaces import ModelOutput
from minivllm.core.scheduler import Scheduler, SchedulerConfig
from minivllm.core.sequence import SequenceGroup
from minivllm.spec_decode import rejection_sampler
from minivllm.spec_decode.chaining import EXPIRE_DECISIONS, ChainPolicy
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.controller import (EXPLORE_EVERY, EXPLORE_SEQS, MAX_QUIET_STEPS, QUIET_BATCH, QUIET_STEPS,
                                             QUIET_STEPS_LARGE_BATCH, SpeculationController)
from minivllm.spec_decode.ngram import NgramProposer
from minivllm.spec_decode.rejection_sampler import SpecDecodeMetadata, rejection_sample
from tests.conftest import make_tiny_hf_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}
DRAFT_LAYERS = {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 3, "adaptive": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}


# ---- pieces --------------------------------------------------------------------------------------------------

def test_ngram_proposes_continuation_of_latest_longest_match():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    #                 0  1  2  3  4  5  6  7  8  9
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]   # latest of two 3-gram matches
    assert proposer.propose([5, 6, 1, 2, 8, 8, 2], 2) == [8, 8]                  # only the 1-gram "2" recurs
    assert proposer.propose([1, 2, 3, 4], 3) == []                               # nothing recurs
    assert proposer.propose([4, 5, 4], 5) == [5, 4]                              # shorter than k near the end
    assert NgramProposer(2, 3).propose([1, 2, 3, 9, 4, 3], 2) == []              # a 1-gram is below the minimum


def test_ngram_matches_a_brute_force_search():
    def brute_force(tokens, k, low, high):
        for n in range(min(high, len(tokens) - 1), low - 1, -1):
            for start in range(len(tokens) - 1 - n, -1, -1):   # latest earlier occurrence first
                if tokens[start:start + n] == tokens[len(tokens) - n:]:
                    return tokens[start + n:start + n + k]
        return []

    rng = np.random.default_rng(0)
    # Ids whose int32 bytes overlap when shifted (0, 1, 256, 65536): some n-grams also occur at an offset
    # that straddles tokens, which must not count as a match.
    alphabets = (np.arange(4), np.array([0, 1, 256, 65536]))
    for i in range(4000):
        tokens = rng.choice(alphabets[i % 2], rng.integers(1, 40)).tolist()
        low = int(rng.integers(1, 4))
        high, k = int(rng.integers(low, 6)), int(rng.integers(1, 6))
        assert NgramProposer(low, high).propose(tokens, k) == brute_force(tokens, k, low, high), (tokens, low, high)


def test_speculative_config_validation():
    assert SpeculativeConfig.from_dict({"draft_layers": 4}).method == "draft_model"
    for bad in ({"method": "medusa"}, {"method": "ngram", "num_speculative_tokens": 0},
                {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
                {"method": "draft_model"}, {"method": "draft_model", "model": "x", "draft_layers": 2},
                {"method": "ngram", "bogus": 1}):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_dict(bad)


def _chi_square_p_value(counts_a: Counter, counts_b: Counter, min_expected: float = 5.0) -> float:
    """Two-sample chi-square test of equal distributions; rare categories are pooled."""
    total_a, total_b = sum(counts_a.values()), sum(counts_b.values())
    keys = sorted(set(counts_a) | set(counts_b))
    cells, pooled = [], [0, 0]
    for key in keys:
        a, b = counts_a.get(key, 0), counts_b.get(key, 0)
        if (a + b) * min(total_a, total_b) / (total_a + total_b) < min_expected:
            pooled[0] += a
            pooled[1] += b
        else:
            cells.append((a, b))
    if sum(pooled):
        cells.append(tuple(pooled))
    statistic = 0.0
    for a, b in cells:
        n = a + b
        for observed, total in ((a, total_a), (b, total_b)):
            expected = n * total / (total_a + total_b)
            statistic += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("deterministic_drafts", [True, False])
def test_rejection_sampling_reproduces_the_target_distribution(deterministic_drafts):
    """Three positions drawn through verification are distributed as three draws from p (the target
    distributions here do not depend on the prefix, so each position's marginal must be p_j)."""
    torch.manual_seed(0)
    vocab, k, n = 6, 2, 40_000
    p = torch.softmax(1.5 * torch.randn(k + 1, vocab), dim=-1)
    q = torch.softmax(torch.randn(k, vocab), dim=-1)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True) for j in range(k)], dim=1)
    if deterministic_drafts:
        drafts = torch.full((n, k), 1)
    probs = p.repeat(n, 1)
    sampled = torch.multinomial(probs, 1).squeeze(1)
    spec = SpecDecodeMetadata(
        row_index=torch.arange(n * (k + 1)).view(n, k + 1), num_drafts=torch.full((n,), k), draft_token_ids=drafts,
        draft_probs=None if deterministic_drafts else q.expand(n, k, vocab), is_greedy=torch.zeros(n, dtype=torch.bool),
        uniform=torch.rand(n, k), residual_noise=torch.empty(n, vocab).exponential_())
    output, num_accepted = rejection_sample(sampled, probs, spec)
    assert 0 < num_accepted.float().mean() < k
    for j in range(k + 1):
        kept = output[:, j][output[:, j] >= 0]
        reference = Counter(torch.multinomial(p[j], len(kept), replacement=True).tolist())
        assert _chi_square_p_value(Counter(kept.tolist()), reference) > 1e-4, f"position {j}"


def test_greedy_verification_accepts_while_argmax_matches():
    # Targets (argmax per position) 5 7 9 2; drafts 5 7 4 -> accept two, then the target's 9.
    sampled = torch.tensor([5, 7, 9, 2])
    spec = SpecDecodeMetadata(
        row_index=torch.tensor([[0, 1, 2, 3]]), num_drafts=torch.tensor([3]), draft_token_ids=torch.tensor([[5, 7, 4]]),
        draft_probs=None, is_greedy=torch.tensor([True]), uniform=torch.rand(1, 3),
        residual_noise=torch.ones(1, 10))
    output, accepted = rejection_sample(sampled, None, spec)
    assert output.tolist() == [[5, 7, 9, -1]] and accepted.tolist() == [2]
    spec.draft_token_ids = torch.tensor([[5, 7, 9]])
    output, accepted = rejection_sample(sampled, None, spec)
    assert output.tolist() == [[5, 7, 9, 2]] and accepted.tolist() == [3]   # all accepted: bonus token


def test_greedy_fast_path_matches_rejection_sampling():
    """All speculating rows greedy: `greedy_verify`, its Triton kernel and its host version give the rows
    that rejection sampling and the scatter give, for random drafts (some matching), draft counts and rows of sequences
    that do not speculate."""
    from minivllm.kernels.greedy_verify import greedy_verify_triton
    from minivllm.layers.sampler import Sampler
    from minivllm.spec_decode.rejection_sampler import greedy_verify, greedy_verify_host
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        num_drafts = torch.randint(1, 6, (4,), generator=generator)
        k = int(num_drafts.max())
        rows, row_index, first = [], [], 1   # row 0 (and a row between sequences) do not speculate
        for d in num_drafts.tolist():
            own = list(range(first, first + d + 1))
            row_index.append(own + [own[-1]] * (k - d))
            first += d + 2
        sampled = torch.randint(0, 4, (first,), generator=generator)   # a small vocabulary: many matches
        row_index = torch.tensor(row_index)
        drafts = torch.where(torch.arange(k) < num_drafts.unsqueeze(1), sampled[row_index[:, :k]], -1)
        flip = (torch.rand(drafts.shape, generator=generator) < 0.3) & (drafts >= 0)
        drafts = torch.where(flip, (drafts + 1) % 4, drafts)
        spec = SpecDecodeMetadata(row_index=row_index, num_drafts=num_drafts, draft_token_ids=drafts,
                                  draft_probs=None, is_greedy=torch.ones(4, dtype=torch.bool),
                                  uniform=torch.rand(4, k), residual_noise=None)
        reference = Sampler._verify(sampled, None, spec)   # uniform set: the general path
        assert torch.equal(greedy_verify(sampled, spec), reference)
        # the one-launch kernel (Triton interpreter here), which writes into its input
        assert torch.equal(greedy_verify_triton(sampled.clone(), row_index, num_drafts, drafts), reference)
        # on the host, on the read-back argmaxes, when the sampler leaves them unverified
        spec.uniform, spec.verify_on_host = None, True
        read_back = Sampler._verify(sampled, None, spec).tolist()
        greedy_verify_host(read_back, row_index.numpy(), num_drafts.numpy(), drafts.numpy())
        assert read_back == reference.tolist()


def test_sampler_verifies_greedy_drafts_next_to_random_rows():
    """A batch whose speculating rows are greedy while another row samples: the random row draws as
    usual, the greedy rows keep their accepted drafts and argmax."""
    from minivllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
    logits = torch.full((4, 8), -5.0)
    logits[0, 3] = logits[1, 4] = logits[2, 6] = 5.0   # argmax per verified position: 3, 4, 6
    logits[3, 1] = 9.0                                 # the random row's near-certain token
    rows = [SamplingRow(SamplingParams(temperature=0), [1], []) for _ in range(3)]
    rows.append(SamplingRow(SamplingParams(temperature=1.0), [1], []))
    spec = SpecDecodeMetadata(
        row_index=torch.tensor([[0, 1, 2]]), num_drafts=torch.tensor([2]), draft_token_ids=torch.tensor([[3, 5]]),
        draft_probs=None, is_greedy=torch.tensor([True]), uniform=None, residual_noise=None)
    out = Sampler()(logits, SamplingMetadata.build(rows, 8, torch.device("cpu")), spec)
    assert out.token_ids.tolist() == [3, 4, -1, 1]


def test_scheduler_rolls_back_rejected_drafts_and_frees_their_blocks():
    block_manager = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), block_manager)
    group = SequenceGroup("r", None, list(range(6)), SamplingParams(max_tokens=20))
    scheduler.add_seq_group(group)
    seq = group.seqs[0]
    out = scheduler.schedule()
    scheduler.update(out, ModelOutput([[100]]))                 # prompt done: 7 tokens, 6 computed
    seq.spec_token_ids = [101, 102, 103, 104, 105]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [6] and out.spec_token_ids == [[101, 102, 103, 104, 105]]
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 12
    scheduler.update(out, ModelOutput([[101, 102, 200]]))       # two accepted, then a corrected token
    assert seq.token_ids[6:] == [100, 101, 102, 200]
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3   # 10 tokens need 3 blocks of 4
    seq.spec_token_ids = [7, 8, 9, 10, 11]
    out = scheduler.schedule()
    scheduler.update(out, ModelOutput([[300]]))                 # nothing accepted
    assert seq.num_computed_tokens == 10 and len(seq.block_table) == 3 and seq.num_tokens == 11
    block_manager.check_integrity([seq])
    # Hashes only for blocks of accepted tokens: blocks 0 and 1 are full and computed.
    assert len(block_manager.cached_block_hash_to_block) == 2
    scheduler.abort_request("r")
    assert block_manager.num_free_blocks == 16


def test_adaptive_controller_turns_speculation_off_when_verification_costs_too_much():
    controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1024)
    group = SequenceGroup("r", None, [1, 2, 3], SamplingParams(max_tokens=1000))
    seq = group.seqs[0]
    seq.append_token(4)
    seq.num_computed_tokens = 3
    assert controller.choose_k([seq]) == 4           # nothing measured: optimistic
    for _ in range(5):
        controller.observe_verification(seq, 4, 1)   # low acceptance (~0.2 per token)
    controller.observe_step(1, 1, 0.010, speculative=False)
    for num_tokens, seconds in ((2, 0.016), (3, 0.024), (5, 0.030)):
        controller.observe_step(num_tokens, 1, seconds, speculative=True)  # verifying 4 drafts costs 3x a decode
    ks = [controller.choose_k([seq]) for _ in range(3 * EXPLORE_EVERY)]
    tries = [i for i, k in enumerate(ks) if k]   # off, but tried again after 32, then 64 more plain steps
    assert tries == [EXPLORE_EVERY - 1, 3 * EXPLORE_EVERY - 1] and set(ks) == {0, 4}
    for _ in range(50):
        controller.observe_verification(seq, 4, 4)   # high acceptance
    for num_tokens in (2, 3, 5) * 20:
        controller.observe_step(num_tokens, 1, 0.011, speculative=True)   # and cheap verification: on again
    assert controller.choose_k([seq]) == 4


def _decoding_batch(size: int) -> list:
    """`size` sequences one decode step in, each with a repeating tail (n-gram lookups find it)."""
    seqs = []
    for i in range(size):
        seq = SequenceGroup(f"r{i}", None, [5, 6, 5, 6, 5], SamplingParams(max_tokens=100)).seqs[0]
        seq.append_token(6)
        seq.num_computed_tokens = 5
        seqs.append(seq)
    return seqs


def test_a_quiet_period_chosen_under_load_ends_when_the_batch_shrinks():
    """Under load k = 0 is decided again only every few steps; once the batch falls below QUIET_BATCH the
    next step decides again (a lone user's repetitive request is not left waiting out a 256-batch wait)."""
    controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                                       max_model_len=1024)
    seqs = _decoding_batch(256)
    controller.observe_step(256, 256, 0.028, speculative=False)
    controller.observe_step(8192, 16, 0.600, speculative=False)
    evaluations = []
    rates = controller.rates
    controller.rates = lambda seqs: evaluations.append(len(seqs)) or rates(seqs)
    assert controller.choose_k(seqs) == 0 and evaluations == [256]
    assert controller.choose_k(seqs) == 0 and evaluations == [256]            # quiet
    controller.choose_k(seqs[:QUIET_BATCH - 1])                               # the batch shrank: decided again
    assert evaluations == [256, QUIET_BATCH - 1]


def test_every_draft_is_held_for_a_few_steps_and_longer_while_the_estimate_repeats_it():
    """At batch 1 with cheap verification and drafts that are mostly accepted, k = max is kept for
    HELD_STEPS steps without a new estimate, then for twice as many plus one while the estimate repeats it, and
    decided again at once when the batch changes size; the optimistic start (nothing measured) is never held."""
    from minivllm.spec_decode.controller import HELD_STEPS
    controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                                       max_model_len=1024)
    seqs = _decoding_batch(2)
    evaluations = []
    rates = controller.rates
    controller.rates = lambda seqs: evaluations.append(len(seqs)) or rates(seqs)
    assert [controller.choose_k(seqs[:1]) for _ in range(2)] == [4, 4] and evaluations == [1, 1]
    controller.observe_step(1, 1, 0.010, speculative=False)
    for _ in range(20):
        controller.observe_verification(seqs[0], 4, 4)
    controller.observe_step(5, 1, 0.011, speculative=True)
    evaluations.clear()
    second_hold = 2 * HELD_STEPS + 1
    steps = 1 + HELD_STEPS + 1 + second_hold + 1
    assert [controller.choose_k(seqs[:1]) for _ in range(steps)] == [4] * steps
    assert evaluations == [1, 1, 1]                  # decided, held, decided (the same plan), held longer, decided
    controller.choose_k(seqs)                        # the batch grew: decided at once
    assert evaluations == [1, 1, 1, 2]
    controller.choose_k(seqs[:1])                    # held for two sequences; back to one: decided at once
    assert evaluations == [1, 1, 1, 2, 1]
    for _ in range(HELD_STEPS + 1):                  # and held afresh: the last hold was for another batch
        controller.choose_k(seqs[:1])
    assert evaluations == [1, 1, 1, 2, 1, 1]


def test_a_quiet_period_doubles_while_the_answer_stays_no_drafts():
    """Where drafts do not pay, k = 0 is decided again after QUIET_STEPS steps, then after twice as many plus one
    while the answer stays 0."""
    controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                                       max_model_len=1024)
    seqs = _decoding_batch(1)
    for _ in range(5):
        controller.observe_verification(seqs[0], 4, 1)   # low acceptance
    controller.observe_step(1, 1, 0.010, speculative=False)
    for num_tokens, seconds in ((2, 0.016), (3, 0.024), (5, 0.030)):
        controller.observe_step(num_tokens, 1, seconds, speculative=True)   # and costly verification
    decided = []
    rates = controller.rates
    controller.rates = lambda seqs: decided.append(step) or rates(seqs)
    waits = [QUIET_STEPS, 2 * QUIET_STEPS + 1, 4 * QUIET_STEPS + 3]   # 3, 7, 15
    for step in range(sum(waits) + len(waits) + 1):
        assert controller.choose_k(seqs) == 0
    assert decided == [0, waits[0] + 1, waits[0] + waits[1] + 2, sum(waits) + 3]


def test_a_plan_for_some_sequences_is_decided_again_every_step():
    """Drafts for one sequence of two (the other's are rejected) are not held: a sequence joining in place of
    one that finished would get none until the hold ended."""
    controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                                       max_model_len=1024)
    seqs = _decoding_batch(2)
    controller.observe_step(2, 2, 0.010, speculative=False)
    for _ in range(20):
        controller.observe_verification(seqs[0], 4, 4)
        controller.observe_verification(seqs[1], 4, 0)
    controller.observe_step(7, 2, 0.011, speculative=True)
    evaluations = []
    rates = controller.rates
    controller.rates = lambda seqs: evaluations.append(len(seqs)) or rates(seqs)
    assert [controller.choose_k(seqs) for _ in range(3)] == [4] * 3 and evaluations == [2, 2, 2]
    assert controller.propose(seqs, 4) == 1 and seqs[0].spec_token_ids and not seqs[1].spec_token_ids


def test_batch_1_speculation_survives_a_warm_up_outlier_and_a_plain_estimate_above_the_verify_cost():
    """The costs an H200 run left (spec_decode_h200.json `cost_model_outlier`): a warm-up's two decode steps of 2
    sequences took 20.4 and 1.5 ms, a 26-token prefill chunk 1.38 ms, batch-1 decode steps 0.53 ms and batch-1 verify
    steps of 16 rows 0.95 ms. The 2-sequence bucket is its lower median (1.5 ms, not the mean of the two), and the
    plain estimate at 16 tokens (interpolated between 2 and 32) is above what the verify steps cost: their extra is
    negative and the two sum to the measured 0.95 ms. With the mean and the extra clipped at 0, every draft was
    priced at 6.5 ms and the whole run decoded plainly."""
    controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=15), max_model_len=4096)
    seq = _decoding_batch(1)[0]
    for seconds in (0.0204, 0.0015):
        controller.observe_step(2, 2, seconds, speculative=False)
    controller.observe_step(26, 1, 0.00138, speculative=False)
    for _ in range(8):
        controller.observe_step(1, 1, 0.00053, speculative=False)
    for _ in range(8):
        controller.observe_step(16, 1, 0.00095, speculative=True)
        controller.observe_verification(seq, 15, 5)
    assert controller.costs.plain(2) == pytest.approx(0.0015)
    assert controller.costs.estimated_verify_cost(16, 1) == pytest.approx(0.00095)
    controller._held.forget()
    assert controller.choose_k([seq]) == 15


def test_a_try_by_a_few_sequences_does_not_price_a_whole_batch_verify_step():
    """A verify step is priced as a plain step of its size plus the measured extra of verifying: a cheap
    try by 4 of 256 sequences (260 tokens, accepted) must not make a whole-batch verify step (512
    tokens, priced from the prefill steps) look as cheap as that try."""
    controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=1, prompt_lookup_min=1),
                                       max_model_len=1024)
    seqs = _decoding_batch(256)
    controller.observe_step(256, 256, 0.028, speculative=False)     # decode step of the batch
    controller.observe_step(4096, 8, 0.300, speculative=False)    # a prefill step
    for seq in seqs[:4]:
        controller.observe_verification(seq, 1, 1)
    controller.observe_step(260, 256, 0.031, speculative=True)      # the try
    assert controller.choose_k(seqs) == 0
    assert controller.costs.estimated_verify_cost(512, 256) > 0.045      # about a 512-token prefill step, plus the extra


def test_under_load_verification_is_priced_like_prefill_and_tries_are_small():
    """At a large batch an unmeasured verify size is priced from the plain steps around it (here a prefill
    of 8,192 tokens), so k stays 0 without a whole-batch try; the periodic try speculates with a few
    sequences only, in turn."""
    controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                                       max_model_len=1024)
    seqs = _decoding_batch(256)
    controller.observe_step(256, 256, 0.028, speculative=False)     # decode step of the batch
    controller.observe_step(8192, 16, 0.600, speculative=False)    # a prefill step
    evaluations = []
    rates = controller.rates
    controller.rates = lambda seqs: evaluations.append(1) or rates(seqs)
    ks = [controller.choose_k(seqs) for _ in range(EXPLORE_EVERY)]
    assert ks[:-1] == [0] * (EXPLORE_EVERY - 1) and ks[-1] == 4
    # At 256 sequences the estimate (host time per sequence) is redone after QUIET_STEPS_LARGE_BATCH steps,
    # then after twice as many plus one while it keeps saying 0: steps 0, 8, 24 of the first 32.
    evaluated_at, step, wait = [], 0, QUIET_STEPS_LARGE_BATCH
    while step < EXPLORE_EVERY:
        evaluated_at.append(step)
        step, wait = step + wait + 1, min(2 * wait + 1, MAX_QUIET_STEPS)
    assert evaluated_at == [0, 8, 24] and len(evaluations) == len(evaluated_at)
    tried = []
    for _ in range(3):   # each try: EXPLORE_SEQS sequences, the next ones each time
        controller._exploring = True
        assert controller.propose(seqs, 4) == EXPLORE_SEQS
        tried.append([i for i, s in enumerate(seqs) if s.spec_token_ids])
    assert tried == [list(range(j * EXPLORE_SEQS, (j + 1) * EXPLORE_SEQS)) for j in range(3)]
    assert controller.choose_k(seqs) == 0 and controller.propose(seqs, 0) == 0


def test_chaining_behind_a_verify_step_weighs_the_host_gap_against_a_wasted_step():
    """Chain when (1 - p) max(0, B + W - G) < p (G - B). Before B and W are measured (B = 0, W = a plain step D):
    at batch 1 on a small model (D = 1.1 ms, gap G = 1.0 ms) even after a rejection; on a large one (D = 5 ms)
    only after a fully accepted verification when such runs go on; before G is measured, only after a fully
    accepted verification. Where the device idles less (G = 0.3 ms, B = 0.1 ms), a measured wasted step decides:
    after a full acceptance (p = 0.85) chain while W = 1.2 ms, not once W = 1.5 ms."""
    seq = _decoding_batch(1)[0]
    step = SimpleNamespace(seqs=[seq], spec_token_ids=[[6, 5, 6]])

    def controller_after_runs(plain: float) -> SpeculationController:
        controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=3), max_model_len=1024)
        controller.observe_step(1, 1, plain, speculative=False)
        for accepted in ([3] * 9 + [1, 0, 0]) * 2:   # runs of full acceptance, and of rejections
            controller.observe_verification(seq, 3, accepted)
        assert controller.full_acceptance_rate(True) == pytest.approx(0.85)
        assert controller.full_acceptance_rate(False) < 0.5
        return controller

    for plain, after_rejection, after_full in ((0.0011, True, True), (0.005, False, True)):
        controller = controller_after_runs(plain)
        controller.observe_verification(seq, 3, 1)
        assert controller.chains(step) is False    # G not measured yet: the last verification rejected
        controller.observe_idle_after_verify(0.0010, waited=True)
        assert controller.chains(step) is after_rejection
        controller.observe_verification(seq, 3, 3)
        assert controller.chains(step) is after_full
    controller = controller_after_runs(0.0011)
    controller.observe_verification(seq, 3, 3)
    controller.observe_idle_after_verify(0.0003, waited=True)
    controller.observe_idle_after_verify(0.0001, waited=False)
    controller.observe_discarded_step(0.0012)
    assert controller.chains(step) is True
    for _ in range(2):   # the median of 1.2, 1.5, 1.5 ms
        controller.observe_discarded_step(0.0015)
    assert controller.chains(step) is False


def test_chaining_samples_expire_so_a_stale_one_cannot_stop_chaining_for_good():
    """B and W are measured only while steps chain. A gap behind a chained step that makes chaining lose (B > G) stops
    it; once EXPIRE_DECISIONS decisions have passed with no new B, the prior (B = 0) decides again and the policy
    chains where that pays; a fresh sample decides in turn. G, measured at every step that waits, stays current."""
    policy = ChainPolicy()
    for accepted in [True] * 9 + [False]:   # p = 0.83 after a fully accepted verification
        policy.observe_verification(7, accepted)
    policy.observe_verification(7, True)
    plain = 0.0011
    policy.observe_idle(0.0003, waited=True)
    assert policy.chains([7], plain)   # (1 - p)(W - G) < p G with B = 0, W = a plain step
    policy.observe_idle(0.0004, waited=False)   # a chained step's gap behind, longer than G
    decisions = 0
    while not policy.chains([7], plain):
        decisions += 1
        policy.observe_idle(0.0003, waited=True)   # the steps that waited keep G measured
        assert decisions <= EXPIRE_DECISIONS
    assert decisions == EXPIRE_DECISIONS and policy.gap_behind is None and policy.host_gap == 0.0003
    policy.observe_idle(0.0004, waited=False)
    assert not policy.chains([7], plain)


def test_ngram_without_matches_lowers_the_proposal_rate():
    controller = SpeculationController(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1),
                                       max_model_len=1024)
    group = SequenceGroup("r", None, list(range(10, 20)), SamplingParams(max_tokens=100))
    seq = group.seqs[0]
    seq.append_token(99)
    seq.num_computed_tokens = 10
    before = controller.rates([seq])[1][0]
    assert controller.propose([seq], 3) == 0 and seq.spec_token_ids == []
    assert controller.rates([seq])[1][0] < before


# ---- the engine: greedy exactness ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_hf_checkpoint(folder, "llama3")
    return str(folder)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-draft")
    make_tiny_hf_checkpoint(folder, "llama-tied-bias", seed=3)   # another architecture variant, same vocabulary
    return str(folder)


def _tiny_llm(model: str, speculative_config=None, **kwargs) -> LLM:
    options = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory=4 * 2**20, max_model_len=256,
                   seed=0, speculative_config=speculative_config)
    options.update(kwargs)
    return LLM(model, **options)


def _repetitive_prompts(count: int, length: int = 40, seed: int = 0) -> list[list[int]]:
    """Prompts with repeated phrases (shared prefixes across prompts), so n-grams recur."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 128, 16).tolist()
    prompts = []
    for _ in range(count):
        phrase = rng.integers(3, 128, 5).tolist()
        body = (phrase * (length // 5 + 1))[:length - 16]
        prompts.append(prefix + body)
    return prompts


def _generate(llm: LLM, prompts, params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.block_manager.check_integrity()
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks
    return outputs


def _engine_variants(tiny_model, tiny_draft):
    return {"ngram": dict(speculative_config=NGRAM), "draft_layers": dict(speculative_config=DRAFT_LAYERS),
            "suffix": dict(speculative_config=SUFFIX, async_scheduling=True),
            "draft_model": dict(speculative_config={"method": "draft_model", "model": tiny_draft,
                                                    "num_speculative_tokens": 2, "adaptive": False})}


@pytest.mark.parametrize("variant", ["ngram", "draft_layers", "draft_model", "suffix"])
def test_greedy_is_token_identical_under_batching_chunking_prefix_hits_and_preemption(variant, tiny_model, tiny_draft):
    prompts = _repetitive_prompts(10)
    params = [SamplingParams(temperature=0, max_tokens=24 + i, ignore_eos=True) for i in range(len(prompts))]
    # Small budget (chunked prefill), a KV pool too small for all (preemption), shared prefixes (hits).
    engine_options = dict(max_num_batched_tokens=64, num_gpu_blocks_override=40, block_size=4, max_num_seqs=8,
                          max_model_len=128)
    reference = _generate(_tiny_llm(tiny_model, **engine_options), prompts, params)
    llm = _tiny_llm(tiny_model, **engine_options, **_engine_variants(tiny_model, tiny_draft)[variant])
    outputs = _generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [r.outputs[0].token_ids for r in reference]
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode.num_draft_tokens > 0
    if variant != "draft_layers":   # a one-layer draft of a random model rarely agrees
        assert stats.spec_decode.num_accepted_tokens > 0


def test_ngram_drafts_behind_the_token_in_flight_keep_greedy_identical(tiny_model):
    """Async scheduling: n-gram drafts proposed while a sequence's newest token is still on the device
    (the match's first token stands in for it) verify to the same greedy tokens, under batching,
    chunked prefill, prefix hits and preemption."""
    prompts = _repetitive_prompts(10)
    params = [SamplingParams(temperature=0, max_tokens=24 + i, ignore_eos=True) for i in range(len(prompts))]
    engine_options = dict(max_num_batched_tokens=64, num_gpu_blocks_override=40, block_size=4, max_num_seqs=8,
                          max_model_len=128)
    reference = _generate(_tiny_llm(tiny_model, **engine_options), prompts, params)
    llm = _tiny_llm(tiny_model, **engine_options, speculative_config=NGRAM, async_scheduling=True)
    outputs = _generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [r.outputs[0].token_ids for r in reference]
    engine = llm.llm_engine
    assert engine.spec.num_proposed_behind > 0 and engine.get_stats().spec_decode.num_accepted_tokens > 0
    assert engine.get_stats().num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("engine_options", [
    dict(max_num_batched_tokens=64, num_gpu_blocks_override=40, block_size=4, max_num_seqs=8, max_model_len=128),
    dict(max_num_seqs=1)], ids=["batched-preempting", "batch1"])
def test_steps_chained_behind_a_verify_step_keep_greedy_identical(tiny_model, engine_options):
    """A verify step whose sequences last had every draft accepted is not read back before the next step
    is scheduled (the chaining rule forced to that, which the measured costs of a CPU, where nothing
    overlaps, never choose): that step guesses every draft accepted. Where a draft is then rejected, the
    scheduler discards that step for the sequence and rolls it back; the output stays token-identical, and
    every block comes back."""
    prompts = _repetitive_prompts(10)
    params = [SamplingParams(temperature=0, max_tokens=24 + i, ignore_eos=True) for i in range(len(prompts))]
    reference = _generate(_tiny_llm(tiny_model, **engine_options), prompts, params)
    llm = _tiny_llm(tiny_model, **engine_options, speculative_config=NGRAM, async_scheduling=True)
    policy = llm.llm_engine.spec.chaining
    policy.chains = lambda seq_ids, plain_cost: all(seq_id in policy.fully_accepted for seq_id in seq_ids)
    outputs = _generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [r.outputs[0].token_ids for r in reference]
    engine = llm.llm_engine
    assert engine.spec.num_chained_steps > 0 and engine.scheduler.num_discarded_steps > 0
    assert engine.spec.chaining.host_gap > 0   # measured after the verify steps that were not chained
    if engine_options.get("max_num_seqs") == 1:   # and after steps discarded whole behind a rejection
        assert engine.spec.chaining.wasted_step > 0
    assert engine.get_stats().num_generation_tokens == sum(len(o.outputs[0].token_ids) for o in outputs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_every_sampling_parameter_behaves_as_without_speculation(tiny_model):
    """Greedy requests with stop token ids, max_tokens, min_tokens, logprobs, penalties and logit bias give
    the same tokens and logprobs with n-gram drafts; seeded sampling is reproducible."""
    prompts = _repetitive_prompts(6, seed=1)
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[prompts[0][20]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=10, stop_token_ids=[prompts[2][18]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, logit_bias={prompts[5][17]: 3.0}, ignore_eos=True),
    ]
    reference = _generate(_tiny_llm(tiny_model), prompts, params)
    # The GPU's engine loop: a verify step stays in flight until the next step, which first reads it
    # back, then schedules, then makes the previous step's outputs.
    llm = _tiny_llm(tiny_model, speculative_config=NGRAM, async_scheduling=True)
    outputs = _generate(llm, prompts, params)
    for ours, ref in zip(outputs, reference):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        assert ours.outputs[0].finish_reason == ref.outputs[0].finish_reason
        assert ours.outputs[0].stop_reason == ref.outputs[0].stop_reason
    for ours, ref in zip(outputs[3].outputs[0].logprobs, reference[3].outputs[0].logprobs):
        assert ours.keys() == ref.keys()
        for token_id in ours:
            assert math.isclose(ours[token_id].logprob, ref[token_id].logprob, abs_tol=1e-4)
    assert llm.llm_engine.get_stats().spec_decode.num_accepted_tokens > 0
    seeded = SamplingParams(temperature=0.9, max_tokens=16, seed=7, ignore_eos=True)
    first = _generate(llm, prompts[:3], seeded)
    again = _generate(llm, prompts[:3] + prompts[3:], seeded)[:3]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


@pytest.mark.parametrize("always_chain", [False, True])
def test_aborts_in_mixed_workloads_leak_no_blocks(tiny_model, always_chain):
    llm = _tiny_llm(tiny_model, speculative_config=NGRAM, num_gpu_blocks_override=48, block_size=4, max_model_len=128,
                    async_scheduling=True)
    engine = llm.llm_engine
    if always_chain:   # so that aborts land while a verify step of the request is still in flight
        engine.spec.chains = lambda scheduled: True
    prompts = _repetitive_prompts(12, seed=2)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0 if i % 2 else 0.8, max_tokens=40, ignore_eos=True, n=1 + (i % 3 == 0))
        engine.add_request(str(i), prompt, params)
    for step in range(60):
        engine.step()
        if step in (5, 12, 20):
            engine.abort_request([str(step % 12), str((step + 1) % 12)])
        engine.block_manager.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.get_stats().spec_decode.num_draft_tokens > 0
    # Nor per-sequence controller state (acceptance counts, n-gram histories) of finished or aborted requests.
    assert not engine.spec._seq_counts and not engine.spec._histories and not engine.spec.chaining.fully_accepted


# ---- the engine: sampling distribution -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory) -> tuple[str, list[int]]:
    """A tiny random model whose next-token distributions are peaked (scaled LM head), and a prompt that
    repeats the model's own greedy continuation, so drafts of both proposers are accepted often enough
    (but not always) for both branches of verification to be exercised."""
    folder = tmp_path_factory.mktemp("tiny-peaked")
    model = make_tiny_hf_checkpoint(folder, "llama3", seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.5)
    model.save_pretrained(str(folder))
    start = [7, 8, 9, 10, 7, 8, 9]
    continuation = _tiny_llm(str(folder)).generate(
        [{"prompt_token_ids": start}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    return str(folder), start + continuation + start


STATISTICS_ENGINE = dict(max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_memory=16 * 2**20)


def _sample_positions(llm: LLM, prompt: list[int], num_samples: int) -> list[Counter]:
    """Histograms of output positions 1 and 2, the ones verified steps produce (position 0 comes from
    the prompt's own step)."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3, ignore_eos=True, n=64)
    outputs = _generate(llm, [prompt] * (num_samples // 64), params)
    tokens = [c.token_ids for o in outputs for c in o.outputs]
    return [Counter(t[j] for t in tokens) for j in (1, 2)]


@pytest.fixture(scope="module")
def reference_distribution(peaked_model) -> list[Counter]:
    model, prompt = peaked_model
    return _sample_positions(_tiny_llm(model, **STATISTICS_ENGINE), prompt, 20_480)


@pytest.mark.parametrize("config", [NGRAM, DRAFT_LAYERS, SUFFIX], ids=["ngram", "draft_layers", "suffix"])
def test_sampled_distribution_equals_non_speculative(config, peaked_model, reference_distribution):
    """20,480 samples at temperature 0.8 with top-p 0.9: the speculated positions are distributed as
    without speculation (two-sample chi-square against the same number of plain samples)."""
    model, prompt = peaked_model
    llm = _tiny_llm(model, speculative_config=config, **STATISTICS_ENGINE)
    speculative = _sample_positions(llm, prompt, 20_480)
    stats = llm.llm_engine.get_stats().spec_decode
    assert 0.05 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.95
    p_values = [_chi_square_p_value(a, b) for a, b in zip(speculative, reference_distribution)]
    print(f"{config['method']}: acceptance {stats.num_accepted_tokens}/{stats.num_draft_tokens}, "
          f"chi-square p-values of positions 1 and 2: {p_values}")
    assert min(p_values) > 1e-3, p_values


def test_broken_acceptance_rule_is_caught(peaked_model, reference_distribution, monkeypatch):
    """The same test fails when verification accepts every draft."""
    monkeypatch.setattr(rejection_sampler, "accept_mask", lambda p, q, u: torch.ones_like(u, dtype=torch.bool))
    model, prompt = peaked_model
    broken = _sample_positions(_tiny_llm(model, speculative_config=NGRAM, **STATISTICS_ENGINE), prompt, 4096)
    p_values = [_chi_square_p_value(a, b) for a, b in zip(broken, reference_distribution)]
    print(f"accept-every-draft rule: chi-square p-values of positions 1 and 2: {p_values}")
    assert min(p_values) < 1e-6, p_values


def test_step_costs_run_from_a_step_start_to_the_next_steps_start(tiny_model):
    """The controller is fed one cost per step, prompt chunks included, each from the step's start to the
    next step's start and charged to that step (launch-to-launch intervals hold the wait for the step
    before); the chain breaks when the engine runs dry, so idle time between requests is never a step's
    cost."""
    llm = _tiny_llm(tiny_model, speculative_config={**NGRAM, "adaptive": True}, async_scheduling=True,
                    max_num_batched_tokens=16, max_num_seqs=4)
    engine = llm.llm_engine
    observed, launched = [], []
    engine.spec.observe_step = lambda num_tokens, num_seqs, seconds, speculative: observed.append((num_tokens, seconds))
    execute = engine.runner.execute_async

    def recording(scheduler_output, *args):
        launched.append(scheduler_output.total_num_scheduled_tokens)
        return execute(scheduler_output, *args)
    engine.runner.execute_async = recording
    prompts = _repetitive_prompts(2, length=40)
    expected = []
    for prompt in prompts:   # one request at a time: the engine runs dry in between
        launched.clear()
        _generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert launched[0] == 16                                  # 40-token prompts in 16-token chunks
        expected += launched[:-1]                                # the request's last launch has no successor
        time.sleep(0.5)
    assert [n for n, _ in observed] == expected                  # each cost charged to its own step, in order
    assert max(seconds for _, seconds in observed) < 0.5       # no step was charged the idle gap