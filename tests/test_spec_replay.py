"""bench/spec_replay.py: the replay's step counts against proposers whose outcome is known, and a quick run
on the real default model that writes its result file."""
from __future__ import annotations

import json
import math

import pytest

from bench.spec_replay import main, replay


class _Oracle:
    """Drafts the recorded continuation itself."""

    def __init__(self, outputs: dict) -> None:
        self.outputs = outputs

    def propose(self, history, k, skip=0):
        prompt, output = self.outputs[history[0]]
        done = len(history) - len(prompt) + skip
        return list(output[done:done + k])


class _Wrong:
    def propose(self, history, k, skip=0):
        return [-1] * k


def test_replay_counts_steps_as_verification_would():
    records = [([7, 1, 2], list(range(100, 140))), ([8, 3], list(range(200, 211)))]
    oracle = _Oracle({prompt[0]: (prompt, output) for prompt, output in records})
    for k in (1, 3, 5):
        result = replay(oracle, records, k)   # every draft accepted: k + 1 tokens a step
        assert result["steps"] == sum(math.ceil((len(output) - 1) / (k + 1)) for _, output in records)
        assert result["acceptance"] == 1.0 and result["verify_steps"] == result["steps"]
    wrong = replay(_Wrong(), records, 4)      # every draft rejected: one token a step, each step a verify step
    assert wrong["steps"] == wrong["verify_steps"] == 39 + 10
    assert wrong["tokens_per_step"] == 1.0 and wrong["acceptance"] == 0.0


def test_drafts_after_a_plain_step_are_made_behind_the_token_in_flight():
    """After a step with no drafts the proposer sees the history without the newest token and skips its
    stand-in (as under async scheduling); after a verify step, the whole history."""
    prompt, output = [7, 1, 2], list(range(100, 120))
    calls = []

    class EveryOther(_Oracle):
        def propose(self, history, k, skip=0):
            calls.append((len(history), skip))
            return [] if len(calls) % 2 else super().propose(history, k, skip)

    result = replay(EveryOther({7: (prompt, output)}), [(prompt, output)], 3)
    assert calls[:3] == [(len(prompt) + 1, 0), (len(prompt) + 1, 1), (len(prompt) + 6, 0)]
    assert result["acceptance"] == 1.0   # the skipped stand-in is the token the plain step produced


@pytest.mark.long
def test_quick_run_writes_every_workload_and_proposer(tmp_path):
    result = main(["--quick", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "spec_replay_cpu.json").read_text())
    assert written["commit"] and set(written["workloads"]) == {"grounded", "open", "repetitive"}
    for entry in result["workloads"].values():
        assert {"ngram", "suffix_own_only"} <= set(entry)
        assert all(row["tokens_per_step"] >= 1.0 for name, row in entry.items() if isinstance(row, dict))
