"""ChainPolicy: whether the step after a verify step may be launched before the verify step is read back
(host side, no torch), and the measurements that decide it.

Not chaining leaves the device idle while the host reads the result back and prepares the next step: the
measured host gap G. Chaining saves G when every draft is accepted; when not, the step launched behind is
discarded for the sequences that rejected, and the next real step waits for it on the device, which costs
max(0, D - G) with D a plain step's cost (the host prepares the real step meanwhile). So chain when
(1 - p) max(0, D - G) < p G, p the chance that all drafts are accepted given the sequence's last
verification (measured: copying runs on). At batch 1 on a small model D is about G and nearly every
verify step chains; on a large one D >> G and only runs of accepted drafts do. Until G is measured: chain
after a fully accepted verification.
"""
from __future__ import annotations

import statistics
from collections import deque

from minivllm.core.step_costs import COST_WINDOW


class ChainPolicy:
    def __init__(self) -> None:
        self.fully_accepted: set[int] = set()   # sequences whose last verification accepted every draft
        self._full_after = {True: [0, 0], False: [0, 0]}   # (fully accepted, verifications) after one that was (not)
        self._host_gaps: deque = deque(maxlen=COST_WINDOW)   # device idle after an unchained verify step
        self.host_gap: float | None = None

    def chains(self, seq_ids: list[int], plain_cost: float | None) -> bool:
        """For a verify step of the sequences `seq_ids` and a plain step costing `plain_cost`."""
        if self.host_gap is None or plain_cost is None:
            return all(seq_id in self.fully_accepted for seq_id in seq_ids)
        p = sum(self.full_acceptance_rate(seq_id in self.fully_accepted) for seq_id in seq_ids) / len(seq_ids)
        return (1.0 - p) * max(0.0, plain_cost - self.host_gap) < p * self.host_gap

    def full_acceptance_rate(self, last_fully_accepted: bool) -> float:
        """The share of verifications that accepted every draft, after one that did (or did not)."""
        full, total = self._full_after[last_fully_accepted]
        return (full + 1) / (total + 2)

    def observe_host_gap(self, seconds: float) -> None:
        """Host time from reading an unchained verify step back to launching the next step (the device idles)."""
        self._host_gaps.append(seconds)
        self.host_gap = statistics.median(self._host_gaps)

    def observe_verification(self, seq_id: int, fully_accepted: bool) -> None:
        last = seq_id in self.fully_accepted
        self._full_after[last][0] += fully_accepted
        self._full_after[last][1] += 1
        if fully_accepted:
            self.fully_accepted.add(seq_id)
        else:
            self.fully_accepted.discard(seq_id)

    def forget(self, seq_id: int) -> None:
        self.fully_accepted.discard(seq_id)
