"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the sequence's last n tokens
in its prompt + output and propose the tokens that followed it, trying n = max .. min.

Runs on the host before scheduling (its proposals decide how many slots a step needs). Matching is
vectorised with numpy over the token history; the only Python loop is over n.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    proposes_on_device = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int] | np.ndarray, k: int) -> list[int]:
        """Up to `k` draft tokens continuing `token_ids`; [] when no n-gram of the tail recurs."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        # Candidate ends: earlier positions holding the last token. Each grows its match backwards one
        # offset at a time, for all candidates at once, up to the longest n-gram asked for.
        ends = np.flatnonzero(tokens[:length - 1] == tokens[-1])
        if ends.size == 0:
            return []
        match_len = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for offset in range(1, min(self.max_n, length - 1)):
            before = ends - offset
            alive &= before >= 0
            alive[alive] &= tokens[before[alive]] == tokens[length - 1 - offset]
            match_len += alive
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            hits = np.flatnonzero(match_len >= n)
            if hits.size:
                start = int(ends[hits[-1]]) + 1  # the most recent match continues best in practice
                return tokens[start:start + k].tolist()
        return []
