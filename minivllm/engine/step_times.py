"""StepTimes: cumulative histograms of what the engine's steps hold and cost (host side, no torch), which
`/metrics` exports at scrape time.

- tokens per step, every step (vLLM's `iteration_tokens_total`);
- with every step timed (`collect_step_times`, or an ITL target), each step's time on the device, from
  its start event (recorded once its inputs are prepared) to its end event (after the copy of its sampled
  ids), and the device's idle time from that end to the next step's start. Idle time that grows with load
  says the host, not the device, sets the pace of the steps.
"""
from __future__ import annotations

import bisect
import math

TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
                   0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Counts per upper bound (the last, +Inf, catches the rest), their sum and count, as Prometheus keeps them."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound, observations at or under it)], infinity last."""
        total, out = 0, []
        for bound, count in zip([*self.bounds, math.inf], self.counts):
            total += count
            out.append((bound, total))
        return out


class StepTimes:
    def __init__(self) -> None:
        self.tokens = Histogram(TOKEN_BUCKETS)
        self.device_seconds = Histogram(SECONDS_BUCKETS)
        self.device_idle_seconds = Histogram(SECONDS_BUCKETS)

    def observe_launch(self, num_tokens: int) -> None:
        self.tokens.observe(num_tokens)

    def observe_device(self, busy: float, idle_after: float) -> None:
        """A timed step: its time on the device and the device's idle time after it, until the next step began."""
        self.device_seconds.observe(busy)
        self.device_idle_seconds.observe(max(0.0, idle_after))
