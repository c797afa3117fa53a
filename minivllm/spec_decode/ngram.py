"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the sequence's last n tokens
in its prompt + output and propose the tokens that followed it, trying n = max .. min.

Runs on the host before scheduling, every step of every speculating sequence (its proposals decide how
many slots a step needs), so it must cost microseconds: the history is an `array('i')` (the controller
keeps one per sequence and appends new tokens), and each n-gram is found by `bytes.rfind` over its raw
int32 bytes, C speed with no per-token Python. A hit at an offset that is not a multiple of 4 straddles
two tokens and is skipped. (A numpy version, matching all candidates at once, spent ~100 us per call on
the H100 host in small-array overheads, 8% of a batch-1 step.)
"""
from __future__ import annotations

from array import array

ITEM = 4   # bytes per token id in the history


def token_history(token_ids) -> array:
    """A history `NgramProposer.propose` reads without converting."""
    return token_ids if isinstance(token_ids, array) else array("i", token_ids)


def latest_match(data: bytes, tail: bytes, end: int) -> int:
    """The token index of the latest occurrence of `tail` in `data` (a history's raw bytes) that ends by byte
    `end`, or -1; hits that straddle two tokens are skipped."""
    while (at := data.rfind(tail, 0, end)) >= 0:
        if at % ITEM == 0:
            return at // ITEM
        end = at + len(tail) - 1   # straddles tokens: look further back
    return -1


class NgramProposer:
    proposes_on_device = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids, k: int, skip: int = 0) -> list[int]:
        """Up to `k` draft tokens continuing `token_ids` (a list or a `token_history`) after its first `skip`
        continuation tokens (which stand for tokens still in flight); [] when no n-gram of the tail recurs."""
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        history = token_history(token_ids)
        data = history.tobytes()
        before_last = ITEM * (length - 1)   # a match must end before the last token
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            at = latest_match(data, data[ITEM * (length - n):], before_last)
            if at >= 0:   # the most recent match continues best in practice
                start = at + n + skip
                return history[start:start + k].tolist()
        return []
