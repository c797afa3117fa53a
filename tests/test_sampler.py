"""Sampler tests on crafted logits: filters keep exact supports, penalties match a written-out reference,
seeded rows are reproducible and independent of the batch, and sampling follows the distribution."""
import math

import pytest
import torch

from minivllm.layers.sampler import (Sampler, SamplingMetadata, SamplingRow, apply_logit_bias, apply_min_p,
                                     apply_min_tokens, apply_penalties, apply_top_k_top_p,
                                     apply_top_k_top_p_min_p, compute_logprobs)
from minivllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
# Probabilities 0.5, 0.3, 0.15, 0.05 placed at shuffled vocabulary positions.
PROBS = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}


def crafted_logits(num_rows: int = 1, offset: float = 0.0) -> torch.Tensor:
    row = torch.tensor([math.log(PROBS[i]) for i in range(4)]) + offset
    return row.repeat(num_rows, 1)


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def sample(rows: list[SamplingRow], logits: torch.Tensor):
    metadata = SamplingMetadata.build(rows, logits.shape[-1], logits.device)
    return Sampler()(logits.clone(), metadata)


def row(output_token_ids=(), prompt_token_ids=(0,), sample_index=0, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt_token_ids), list(output_token_ids), sample_index)


# ---- filters (pure functions) ---------------------------------------------------------------------------------

def test_top_k_keeps_exactly_the_k_largest_per_row():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    k = torch.tensor([1, 5, 17, 30])
    expected = [set(row.topk(int(kk)).indices.tolist()) for row, kk in zip(logits, k)]
    assert kept(apply_top_k_top_p(logits.clone(), k, None, max_k=30)) == expected  # candidates from topk
    assert kept(apply_top_k_top_p(logits.clone(), k, None)) == expected  # full sort
    assert kept(apply_top_k_top_p(logits.clone(), k, torch.ones(4), max_k=30)) == expected


def test_topk_candidates_and_full_sort_agree():
    torch.manual_seed(7)
    logits = torch.randn(9, 50) * 2
    k = torch.tensor([5, 10, 20] * 3)
    top_p = torch.tensor([0.5] * 3 + [0.9] * 3 + [1.0] * 3)
    by_topk = apply_top_k_top_p(logits.clone(), k, top_p, max_k=20)
    by_sort = apply_top_k_top_p(logits.clone(), k, top_p)
    torch.testing.assert_close(by_topk, by_sort)
    assert [len(s) for s in kept(by_sort)[6:]] == [5, 10, 20]


# A common shift of the logits changes fp32 rounding: at the two negative ones the {2, 0} mass rounds under 0.8.
@pytest.mark.parametrize("offset", [0.0, -11.0187, -10.5364, 1.48, 5.55])
def test_top_p_keeps_the_minimal_nucleus(offset):
    logits = crafted_logits(4, offset)
    top_p = torch.tensor([0.8, 0.81, 0.4, 1.0])
    assert kept(apply_top_k_top_p(logits, None, top_p)) == [{2, 0}, {2, 0, 3}, {2}, {0, 1, 2, 3}]


def test_top_p_near_one_keeps_every_token_with_mass():
    logits = crafted_logits(1)
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.999]))) == [{0, 1, 2, 3}]


def test_min_p_support_is_exact():
    logits = crafted_logits(4, offset=3.0)  # min-p is relative: an offset on all logits changes nothing
    min_p = torch.tensor([0.2, 0.7, 0.0, 0.09])  # thresholds 0.1, 0.35, off, 0.045
    assert kept(apply_min_p(logits, min_p)) == [{2, 0, 3}, {2}, {0, 1, 2, 3}, {0, 1, 2, 3}]


def test_combined_filters_follow_vllm_order():
    # min-p first (drops p=0.05), then top-k, then top-p on the re-normalised rest.
    logits = crafted_logits(3)
    k = torch.tensor([3, 4, 4])
    top_p = torch.tensor([0.7, 0.82, 0.82])
    min_p = torch.tensor([0.0, 0.2, 0.0])
    # row 0: top-3 = {.5,.3,.15} -> masses .53,.32,.16 -> nucleus for .7 = {2, 0}
    # row 1: min-p leaves .5,.3,.15 -> .53+.32 = .84 >= .82 -> {2, 0}
    # row 2: no min-p: .5+.3 = .8 < .82 -> {2, 0, 3}
    assert kept(apply_top_k_top_p_min_p(logits, k, top_p, min_p)) == [{2, 0}, {2, 0}, {2, 0, 3}]


@pytest.mark.parametrize("params, support", [
    (dict(top_k=2), {2, 0}),
    (dict(top_p=0.8), {2, 0}),
    (dict(top_p=0.81), {2, 0, 3}),
    (dict(min_p=0.2), {2, 0, 3}),
    (dict(top_k=3, top_p=0.7, temperature=0.7), {2, 0}),
    (dict(temperature=1.5), {0, 1, 2, 3}),
])
def test_draws_cover_exactly_the_support(params, support):
    torch.manual_seed(1)
    num_draws = 2000
    tokens = sample([row(**params)] * num_draws, crafted_logits(num_draws)).token_ids
    assert set(tokens.tolist()) == support


# ---- greedy, penalties, bias, min_tokens ----------------------------------------------------------------------

def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    torch.manual_seed(2)
    logits = torch.randn(6, 40)
    rows = [row(temperature=0.0), row(temperature=1.0), row(temperature=0.0, top_k=3),
            row(temperature=2.0, seed=5), row(temperature=0.0, seed=1), row(temperature=1e-6)]
    tokens = sample(rows, logits).token_ids
    greedy = [0, 2, 4, 5]
    assert tokens[greedy].tolist() == logits.argmax(-1)[greedy].tolist()
    all_greedy = sample([row(temperature=0.0)] * 6, logits).token_ids
    assert all_greedy.tolist() == logits.argmax(-1).tolist()


def reference_process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Bias, min_tokens, repetition, frequency and presence penalties, one token at a time."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        for token_id, value in (p.logit_bias or {}).items():
            out[i, token_id] += value
        if len(r.output_token_ids) < p.min_tokens:
            for token_id in p.all_stop_token_ids:
                out[i, token_id] = -math.inf
        seen = set(r.prompt_token_ids) | set(r.output_token_ids)
        for token_id in range(out.shape[1]):
            x = out[i, token_id].item()
            if token_id in seen:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = r.output_token_ids.count(token_id)
            x -= p.frequency_penalty * count
            x -= p.presence_penalty * (count > 0)
            out[i, token_id] = x
    return out


def test_penalties_bias_and_min_tokens_match_reference():
    torch.manual_seed(3)
    vocab = 12
    logits = torch.randn(4, vocab) * 3
    rows = [
        row(output_token_ids=[1, 1, 4, 7, 1], prompt_token_ids=[2, 3, 4], repetition_penalty=1.7,
            frequency_penalty=0.6, presence_penalty=-0.4, logit_bias={5: 2.5, 1: -1.0}),
        row(output_token_ids=[9], prompt_token_ids=[0, 9, 10, 11, 0], repetition_penalty=0.8),
        row(output_token_ids=[2, 2], prompt_token_ids=[1], min_tokens=3, logit_bias={2: 1.0}),
        row(output_token_ids=[6, 6, 6], prompt_token_ids=[6], frequency_penalty=2.0, min_tokens=3),
    ]
    rows[2].params.all_stop_token_ids = {3, 8}
    rows[3].params.all_stop_token_ids = {3}  # min_tokens reached: not masked
    metadata = SamplingMetadata.build(rows, vocab, CPU)
    out = apply_logit_bias(logits.clone(), *metadata.logit_bias)
    out = apply_min_tokens(out, *metadata.min_tokens_mask)
    out = apply_penalties(out, metadata.prompt_tokens, metadata.output_tokens, metadata.presence_penalties,
                          metadata.frequency_penalties, metadata.repetition_penalties)
    torch.testing.assert_close(out, reference_process(logits, rows))
    assert torch.isinf(out[2, [3, 8]]).all() and torch.isfinite(out[3]).all()


def test_no_penalty_tensors_without_penalties():
    metadata = SamplingMetadata.build([row(output_token_ids=[1, 2]), row(temperature=0.0)], 8, CPU)
    assert metadata.prompt_tokens is None and metadata.repetition_penalties is None
    assert metadata.logit_bias is None and metadata.min_tokens_mask is None and metadata.top_k is None


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample([row(temperature=0.0)], logits).token_ids.tolist() == [0]
    penalised = row(temperature=0.0, output_token_ids=[0], repetition_penalty=1.2)
    assert sample([penalised], logits).token_ids.tolist() == [1]


def test_min_tokens_bans_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 10.0, 0.0, 9.0]] * 2)
    young, grown = row(temperature=0.0, min_tokens=2, output_token_ids=[3]), \
        row(temperature=0.0, min_tokens=2, output_token_ids=[3, 3])
    for r in (young, grown):
        r.params.all_stop_token_ids = {1}
    assert sample([young, grown], logits).token_ids.tolist() == [3, 1]


def test_logit_bias_outside_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingMetadata.build([row(logit_bias={10: 1.0})], 10, CPU)


# ---- random sampling --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_sampling_follows_the_distribution(temperature):
    torch.manual_seed(4)
    num_draws = 20_000
    tokens = sample([row(temperature=temperature)] * num_draws, crafted_logits(num_draws)).token_ids
    weights = torch.tensor([PROBS[i] for i in range(4)]) ** (1.0 / temperature)
    expected = weights / weights.sum()
    freq = torch.bincount(tokens, minlength=4).double() / num_draws
    sigma = (expected * (1 - expected) / num_draws).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma).all(), (freq, expected)


def test_seeded_row_is_reproducible_and_independent_of_the_batch():
    torch.manual_seed(5)
    vocab = 1000
    logits = torch.randn(1, vocab) * 0.1  # nearly uniform: a different noise draw gives another token
    seeded = [row(seed=42, output_token_ids=list(range(n))) for n in range(6)]
    alone = [sample([r], logits).token_ids.item() for r in seeded]
    assert len(set(alone)) > 1  # the position enters the seed
    others = [row(), row(seed=7, output_token_ids=[1, 2, 3]), row(temperature=0.0), row(seed=42, sample_index=1)]
    for position, r in enumerate(seeded):
        batch = others[:position % 3] + [r] + others[position % 3:]
        tokens = sample(batch, logits.repeat(len(batch), 1)).token_ids
        assert tokens[position % 3].item() == alone[position]


def test_seeded_siblings_differ():
    vocab = 1000
    logits = torch.zeros(4, vocab)
    streams = [[sample([row(seed=3, sample_index=i, output_token_ids=[0] * n)], logits[:1]).token_ids.item()
                for n in range(4)] for i in range(4)]
    assert len({tuple(s) for s in streams}) == 4
    batched = sample([row(seed=3, sample_index=i) for i in range(4)], logits).token_ids.tolist()
    assert batched == [s[0] for s in streams]


# ---- logprobs ---------------------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(6)
    logits = (torch.randperm(30).repeat(3, 1) / 7).to(torch.bfloat16)  # distinct values: ranks are unambiguous
    rows = [row(logprobs=3, repetition_penalty=1.5, output_token_ids=[1, 2], temperature=0.7, top_k=5),
            row(logprobs=0, temperature=0.0, logit_bias={7: 50.0}),
            row(temperature=1.0)]
    out = sample(rows, logits)
    raw = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(compute_logprobs(logits), raw)
    assert out.logprobs.shape == out.logprob_token_ids.shape == (3, 4)
    assert out.token_ids[1].item() == 7  # bias decides the sample but not the reported logprob
    for i in range(3):
        chosen = out.token_ids[i].item()
        assert out.logprob_token_ids[i, 0].item() == chosen
        torch.testing.assert_close(out.logprobs[i], raw[i, out.logprob_token_ids[i]])
        order = raw[i].argsort(descending=True).tolist()
        assert out.logprob_token_ids[i, 1:].tolist() == order[:3]
        assert out.ranks[i].item() == order.index(chosen) + 1


def test_no_logprobs_when_no_row_asks():
    out = sample([row(), row(temperature=0.0)], torch.randn(2, 9))
    assert out.logprobs is None and out.logprob_token_ids is None and out.ranks is None
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (2,)
