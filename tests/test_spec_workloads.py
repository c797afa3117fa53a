"""bench/spec_workloads.py: the speculation benchmark's prompt sets are as large and as distinct as it says."""
from __future__ import annotations

import pytest

from bench.spec_decode import COMPARE_CASES
from bench.spec_workloads import BATCH1_PROMPTS, WORKLOADS, grounded_chats


def test_every_grounded_prompt_has_its_own_passage_or_function():
    largest = max(count for _, workload, _, count in COMPARE_CASES if workload == "grounded")
    chats = grounded_chats(largest)
    texts = [chat[0]["content"] for _, chat in chats]
    assert len(texts) == largest
    # the text a prompt hands over (after its instruction) is in no other prompt
    given = [text.split("\n\n", 1)[1] for text in texts]
    assert len(set(given)) == largest
    assert [kind for kind, _ in chats[:3]] == ["summarise", "rewrite", "code-edit"]


def test_asking_for_more_grounded_prompts_than_are_distinct_is_an_error():
    with pytest.raises(ValueError, match="distinct"):
        grounded_chats(10_000)


def test_batch_one_sets_exist_at_their_sizes():
    for workload, count in BATCH1_PROMPTS.items():
        chats = WORKLOADS[workload](count)
        assert len(chats) == count
        assert len({chat[0]["content"] for _, chat in chats}) == count
