"""ChainPolicy: whether the step after a verify step may be launched before the verify step is read back
(host side, no torch), and the measurements that decide it.

Three device times, each measured from CUDA events (the runner's `StepStart` before a step's forward pass
and after the copy of its sampled ids):
- G, the gap: the device idles from the end of a verify step that is not chained until the next step
  starts, while the host reads it back, proposes, schedules and prepares that step;
- B, the gap behind: the device's idle from the end of a verify step to the start of a step chained behind
  it (0 when the host launches faster than the device runs; the host's overrun when it does not);
- W, a wasted step: from the start of a chained step whose every sequence rejected a draft before it (the
  step is discarded) to the start of the step after it.
A chained step that stands gains G - B; one that is discarded loses B + W - G against not chaining (the real
step follows it, W after it started, instead of G after the verify step). So chain when
p (G - B) > (1 - p) (B + W - G), p the chance that all drafts are accepted given the sequence's last
verification (measured: copying runs on). On a large model W is a whole device step and only runs of
accepted drafts chain; at batch 1 on a small model, where the host launches a step about as fast as the
device runs it, G is short, a discarded step wastes the host's time as well, and chaining pays only when
nearly every draft is accepted, or when the host is slow and G long. Until G is measured: chain after a
fully accepted verification; until B and W are, take B = 0 and W = a plain step.

B and W are measured only while steps chain (and G only while they do not), so a sample saying that chaining
does not pay would otherwise decide for good: on an H200 the one step that the real model's grounded prompts
chained in a first run left B at 363 us, and none chained in four more runs, with G up to 256 us
(spec_decode_h200.json `chain_policy_stale_sample`). So every sample counts for EXPIRE_DECISIONS chain
decisions; after that its estimate falls back to the prior and is measured afresh where the decision then
calls for it.
"""
from __future__ import annotations

import statistics
from collections import deque

from minivllm.core.step_costs import COST_WINDOW

EXPIRE_DECISIONS = 256   # chain decisions that a measured gap or wasted step counts for


class ChainPolicy:
    def __init__(self) -> None:
        self.fully_accepted: set[int] = set()   # sequences whose last verification accepted every draft
        self._full_after = {True: [0, 0], False: [0, 0]}   # (fully accepted, verifications) after one that was (not)
        # the latest COST_WINDOW samples of each: (chain decisions made when taken, seconds)
        self._samples = {name: deque(maxlen=COST_WINDOW) for name in ("gap", "behind", "wasted")}
        self._decisions = 0

    @property
    def host_gap(self) -> float | None:   # G
        return self._estimate("gap")

    @property
    def gap_behind(self) -> float | None:   # B
        return self._estimate("behind")

    @property
    def wasted_step(self) -> float | None:   # W
        return self._estimate("wasted")

    def _estimate(self, name: str) -> float | None:
        """The median of the samples taken within the last EXPIRE_DECISIONS decisions; None without any."""
        oldest = self._decisions - EXPIRE_DECISIONS
        fresh = [seconds for taken, seconds in self._samples[name] if taken >= oldest]
        return statistics.median(fresh) if fresh else None

    def chains(self, seq_ids: list[int], plain_cost: float | None) -> bool:
        """For a verify step of the sequences `seq_ids` and a plain step costing `plain_cost`."""
        self._decisions += 1
        gap = self.host_gap
        if gap is None or plain_cost is None:
            return all(seq_id in self.fully_accepted for seq_id in seq_ids)
        p = sum(self.full_acceptance_rate(seq_id in self.fully_accepted) for seq_id in seq_ids) / len(seq_ids)
        behind, wasted = self.gap_behind, self.wasted_step
        behind = 0.0 if behind is None else behind
        wasted = plain_cost if wasted is None else wasted
        return (1.0 - p) * max(0.0, behind + wasted - gap) < p * (gap - behind)

    def full_acceptance_rate(self, last_fully_accepted: bool) -> float:
        """The share of verifications that accepted every draft, after one that did (or did not)."""
        full, total = self._full_after[last_fully_accepted]
        return (full + 1) / (total + 2)

    def observe_idle(self, seconds: float, waited: bool) -> None:
        """The device's idle time from a verify step's end to the next step's start: G when the next step
        waited for the verify step's read-back, B when it was chained behind it."""
        self._samples["gap" if waited else "behind"].append((self._decisions, seconds))

    def observe_discarded(self, seconds: float) -> None:
        """From the start of a step that was discarded for every sequence to the next step's start (W)."""
        self._samples["wasted"].append((self._decisions, seconds))

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
