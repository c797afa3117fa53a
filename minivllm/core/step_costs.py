"""StepCosts: what a step costs, measured on the device (host side, no torch). The speculation controller
prices draft lengths with it, and the scheduler sizes prompt chunks under an ITL target with it
(`tokens_within`).

A step's cost is the time from its start on the device to the next step's start (the engine measures it
with the runner's `StepStart`): its device time plus any time the device then idled for the host, so a
verify step that is waited for (no async overlap) carries the host work that waited for its result.
(Launch-to-launch host intervals would charge the wrong step: under async scheduling the one from launch
j to launch j + 1 holds the wait for step j - 1, so at 256 sequences a 4,096-token bucket would read
4.3 ms against 199 ms for the 8,192-token one.)

Plain costs are the lower median of the last few steps in each power-of-two bucket of scheduled tokens; a verify
step is priced as a plain step of its size plus the lower median of the extra that recent verify steps of about as many
sequences cost over the plain estimate. A plain step of a size never measured is estimated by linear
interpolation in the token count between the measured buckets around it, prefill chunks included (a
step's cost is about affine in its tokens), or, with none above it, assumed to cost the plain step below:
at batch 1 a verify step is then tried and judged on its measured extra, while at high load, where
verifying B x (1 + k) tokens costs like a prefill of that size, drafts are not tried.

The scheduler asks the inverse question, the most tokens a plain step may hold and still end within a
time, and must not be optimistic: a step that overruns delays every running decode. So `tokens_within`
places each bucket's cost at the median token count of its steps (not at the bucket's edge), interpolates
between those points, and above the largest one extrapolates along the last segment's slope, or, with one
point, in proportion to tokens (a step then costs as if all of it were per-token work: an overestimate);
and it never goes past twice the largest measured step, so unmeasured sizes are reached by doubling, each
measured before the next.
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque

# Recent step times kept per bucket. Their lower median is the cost: outliers (a compile, a shape's first graph replay,
# a garbage collection) only ever lengthen a step, and with two samples a median would be their mean. On an H200 a
# warm-up's decode steps of 2 sequences took 20.4 and 1.5 ms; priced at their mean, they turned speculation off for
# a whole batch-1 run (bench/results/spec_decode_h200.json `cost_model_outlier`).
COST_WINDOW = 8


def token_bucket(num_tokens: int) -> int:
    return 1 << max(0, num_tokens - 1).bit_length()


def _record(windows: dict[int, deque], medians: dict[int, float], bucket: int, value: float,
            buckets: list[int]) -> None:
    """Add `value` to its bucket's window of recent values and refresh that bucket's median (`buckets`:
    the measured buckets, kept sorted)."""
    window = windows.get(bucket)
    if window is None:
        window = windows[bucket] = deque(maxlen=COST_WINDOW)
        bisect.insort(buckets, bucket)
    window.append(value)
    medians[bucket] = statistics.median_low(window)


class StepCosts:
    def __init__(self) -> None:
        self.plain_windows: dict[int, deque] = {}   # token bucket -> recent seconds, steps without drafts
        self.plain_token_windows: dict[int, deque] = {}   # token bucket -> those steps' token counts
        self.extra_windows: dict[int, deque] = {}   # sequence bucket -> verify steps' extra seconds
        # Their medians, kept up to date as steps are observed, and the measured buckets in order: the
        # controller reads them for every candidate of every step (at batch 1 its host time shows).
        self._plain_median: dict[int, float] = {}
        self._plain_token_median: dict[int, float] = {}
        self._extra_median: dict[int, float] = {}
        self._plain_buckets: list[int] = []
        self._extra_buckets: list[int] = []

    @property
    def measured(self) -> bool:
        """Both plain and verify steps measured (not the optimistic start)."""
        return bool(self._extra_buckets and self._plain_buckets)

    def observe(self, num_tokens: int, num_seqs: int, seconds: float, speculative: bool) -> None:
        if not speculative:
            bucket = token_bucket(num_tokens)
            _record(self.plain_token_windows, self._plain_token_median, bucket, num_tokens, [])
            _record(self.plain_windows, self._plain_median, bucket, seconds, self._plain_buckets)
            return
        plain = self.plain_at(num_tokens)
        if plain is not None:
            _record(self.extra_windows, self._extra_median, token_bucket(num_seqs), seconds - plain,
                    self._extra_buckets)

    def plain(self, num_tokens: int) -> float | None:
        """The median recent cost of plain steps in the largest measured bucket up to `num_tokens`."""
        i = bisect.bisect_right(self._plain_buckets, token_bucket(num_tokens))
        return self._plain_median[self._plain_buckets[i - 1]] if i else None

    def plain_at(self, num_tokens: int) -> float | None:
        """Plain steps' cost interpolated at `num_tokens`: affine between the measured buckets around it
        (prefill chunks included), or the bucket below when none is above."""
        buckets, medians = self._plain_buckets, self._plain_median
        i = bisect.bisect_right(buckets, token_bucket(num_tokens))
        if not i:
            return None
        low = buckets[i - 1]
        if i == len(buckets):
            return medians[low]
        high = buckets[i]
        return medians[low] + (medians[high] - medians[low]) * (num_tokens - low) / (high - low)

    def verify_extra(self, num_seqs: int) -> float | None:
        """What verifying adds to a plain step of the same size: the lower median of the extra over the plain estimate
        of recent verify steps of about as many sequences (the nearest measured bucket; None before any).
        It may be negative: the plain estimate at a verify step's size is interpolated between buckets measured at
        other batch sizes (or prefill chunks), and only the sum of the two prices the step. Clipped at 0, a plain
        estimate above the verify steps' measured cost priced every verify step at that estimate.
        The extra is mostly host work per sequence that waits for the result, not per draft: keyed by
        tokens, the draft lengths of one batch fell into different buckets whose few samples (chained
        verify steps cost little, unchained ones a host step more) made k = 3 look cheaper than k = 5 at
        random. So a try by a few sequences of a large batch prices the whole batch's verify step only by
        its extra, the tokens being priced as a plain step."""
        if not self._extra_buckets:
            return None
        bits = token_bucket(num_seqs).bit_length()
        nearest = min(self._extra_buckets, key=lambda b: (abs(b.bit_length() - bits), b))
        return self._extra_median[nearest]

    def estimated_verify_cost(self, num_tokens: int, num_seqs: int) -> float | None:
        """A plain step of `num_tokens` plus `verify_extra(num_seqs)`."""
        plain = self.plain_at(num_tokens)
        extra = self.verify_extra(num_seqs)
        return plain if plain is None or extra is None else plain + extra

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a plain step may hold with its estimated cost at most `seconds`: 0 when even the
        smallest measured step costs more, None before any plain step is measured (see the module docstring
        for why the estimate leans high)."""
        points = [(self._plain_token_median[b], self._plain_median[b]) for b in self._plain_buckets]
        if not points:
            return None
        x_top, y_top = points[-1]
        if len(points) == 1:
            slope = y_top / x_top
        else:
            x_low, y_low = points[-2]
            slope = (y_top - y_low) / (x_top - x_low) if y_top > y_low else 0.0
        if seconds >= y_top:
            above = 2 * x_top if slope <= 0 else min(2 * x_top, x_top + (seconds - y_top) / slope)
            return int(above)
        for (x0, y0), (x1, y1) in zip(reversed(points[:-1]), reversed(points[1:])):
            # Walking down from the top: the first segment that comes under `seconds` holds the answer.
            if y0 <= seconds:
                return int(x0 + (seconds - y0) * (x1 - x0) / (y1 - y0))   # y1 > seconds >= y0
        return 0
