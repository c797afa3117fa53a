"""The batch-1 chain continuation (kernels/ngram_continue.py), reference and kernel, against a brute force built
from the host's NgramProposer and a plain count of accepted drafts: histories with repeats, every acceptance from
none to all, drafts cut at the history's end, no match, a step with no drafts. Interpreted on CPU."""
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from minivllm.kernels.ngram_continue import ngram_continue_reference, ngram_continue_triton  # noqa: E402
from minivllm.spec_decode.ngram import NgramProposer  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 4


def _case(seed: int, num_prev: int, accepted: int, num_drafts: int, vocab: int, length: int):
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(length)]          # the sequence up to and including p0
    truth = [rng.randrange(vocab) for _ in range(num_prev + 1)]      # the targets the verify step computed
    drafts = truth[:accepted] + [(t + 1) % vocab for t in truth[accepted:num_prev]]   # rejected from `accepted` on
    p0 = length - 1
    size = length + 2 * 16 + 2
    history = torch.full((size,), 7, dtype=torch.int64)
    history[:length] = torch.tensor(tokens)
    history[length:length + num_prev] = torch.tensor(drafts, dtype=torch.int64)
    prev_tokens = torch.tensor(truth, dtype=torch.int64)
    rows = 1 + num_drafts
    start = p0 + 1 + num_prev                                           # the step's first row, all accepted
    positions = torch.arange(start, start + rows, dtype=torch.int64)
    table = torch.randperm(size // BLOCK_SIZE + 1, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    expected_tokens = tokens + truth[:accepted + 1]
    proposal = NgramProposer(2, 4).propose(expected_tokens, num_drafts) if num_drafts else []
    return (history, prev_tokens, p0, num_prev, num_drafts, positions, table), expected_tokens, proposal


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("seed,num_prev,accepted,num_drafts,vocab,length", [
    (0, 5, 0, 5, 3, 40),      # small vocabulary: long matches everywhere
    (1, 5, 5, 15, 3, 40),
    (2, 15, 7, 15, 4, 300),   # several search blocks
    (3, 3, 2, 4, 1000, 30),   # a large vocabulary: usually no match
    (4, 4, 1, 0, 5, 20),      # a plain step behind the verify step
    (5, 0, 0, 6, 2, 10),
    (6, 7, 3, 15, 3, 1500),
])
def test_matches_brute_force(impl, seed, num_prev, accepted, num_drafts, vocab, length):
    (history, prev_tokens, p0, num_prev, num_drafts, positions, table), expected, proposal = _case(
        seed, num_prev, accepted, num_drafts, vocab, length)
    rows = 1 + num_drafts
    input_ids = torch.full((rows,), 9, dtype=torch.int64)
    slot_mapping = torch.zeros(rows, dtype=torch.int64)
    context_lens = (positions + 1).to(torch.int32)
    drafts = torch.full((16,), 5, dtype=torch.int64)
    tensors = [t.to(DEVICE) for t in (history, prev_tokens, input_ids, positions, slot_mapping, table, context_lens,
                                      drafts)]
    history_d, prev_d, input_ids_d, positions_d, slots_d, table_d, lens_d, drafts_d = tensors
    fn = ngram_continue_reference if impl == "reference" else ngram_continue_triton
    fn(history_d, prev_d, p0, num_prev, num_drafts, 2, 4, input_ids_d, positions_d, slots_d, table_d, BLOCK_SIZE,
       lens_d, drafts_d)
    length = len(expected)
    assert history_d[:length].tolist() == expected
    padded = proposal + [-1] * (num_drafts - len(proposal))
    assert drafts_d[:num_drafts].tolist() == padded
    assert history_d[length:length + num_drafts].tolist() == padded
    assert input_ids_d.tolist() == [expected[-1]] + [max(d, 0) for d in padded]
    moved = list(range(length - 1, length - 1 + rows))      # the new token's position, then the drafts'
    assert positions_d.tolist() == moved
    assert lens_d.tolist() == [p + 1 for p in moved]
    assert slots_d.tolist() == [int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in moved]


def test_a_no_draft_entry_never_counts_as_accepted():
    """-1 in the history (no draft) against -1 in a target row (a device verification's rejected rows)."""
    history = torch.tensor([1, 2, 3, 4, -1, -1, 0, 0, 0, 0, 0, 0], dtype=torch.int64)
    prev = torch.tensor([5, -1, -1], dtype=torch.int64)
    input_ids, positions = torch.zeros(1, dtype=torch.int64), torch.tensor([6], dtype=torch.int64)
    slots, lens, drafts = torch.zeros(1, dtype=torch.int64), torch.tensor([7], dtype=torch.int32), torch.zeros(16, dtype=torch.int64)
    ngram_continue_reference(history, prev, 3, 2, 0, 2, 4, input_ids, positions, slots,
                             torch.arange(4, dtype=torch.int32), 4, lens, drafts)
    assert history[:5].tolist() == [1, 2, 3, 4, 5] and positions.tolist() == [4] and input_ids.tolist() == [5]
