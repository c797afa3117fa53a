"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the sequence's last n tokens
in its prompt + output and propose the tokens that followed it, trying n = max .. min.

Runs on the host before scheduling (its proposals decide how many slots a step needs). Matching is
vectorised with numpy over the token history; the only Python loop is over n.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    proposes_on_device = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int] | np.ndarray, k: int) -> list[int]:
        """Up to `k` draft tokens continuing `token_ids`; [] when no n-gram of the tail recurs."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = tokens[length - n:]
            # Windows that start early enough to have at least one token after them (not the tail itself).
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent match continues best in practice
                return tokens[start:start + k].tolist()
        return []
