"""Which running sequences speculate in the next step, and with how many drafts (host side, no torch).

Adaptive speculation: before each step the controller picks one draft length k for the batch (0 means
plain decoding) to maximise expected tokens per second:

    E[tokens](k) = sum over sequences of 1 + h * (a + a^2 + ... + a^k)
    cost(k)      = measured wall time of a step computing B * (1 + k) tokens (B running sequences)

with a the sequence's acceptance rate per draft (accepted / (accepted + rejected)) and h the share of its
tries in which the proposer had anything to propose (n-gram lookups often find nothing), each with a
prior from all sequences. A step's cost is the time from its start on the device to the next step's start
(the engine measures it with the runner's `StepStart`): its device time plus any time the device then
idled for the host, so a verify step that is waited for (no async overlap) carries the host work that
waited for its result. (Launch-to-launch host intervals would charge the wrong step: under async
scheduling the one from launch j to launch j + 1 holds the wait for step j - 1, so at 256 sequences a
4,096-token bucket would read 4.3 ms against 199 ms for the 8,192-token one.) Plain costs are the median of the
last few steps in each power-of-two bucket of scheduled tokens; a verify step is priced as a plain step
of its size plus the median extra that recent verify steps of about as many sequences cost over the plain
estimate. A plain step of a size never measured is estimated by linear interpolation in the token count
between the measured buckets around it, prefill chunks included (a step's cost is about affine in its
tokens), or, with none above it, assumed to cost the plain step below: at batch 1 a verify step is then
tried and judged on its measured extra, while at high load, where verifying B * (1 + k) tokens costs like
a prefill of that size, k stays 0 without trying. While k stays 0, speculation is tried again after
`EXPLORE_EVERY` plain steps, so a workload that turns repetitive is noticed, but only by `EXPLORE_SEQS`
sequences (in turn): a try costs a few tokens, not a verify step of the whole batch (at 256 x 512 -> 256
on an H100, whole-batch tries cost 4.6% of throughput). Each try that does not switch speculation back on
doubles the wait (up to `MAX_EXPLORE_EVERY`), so a proposer that never pays (a draft too weak for the
target) costs almost nothing. The estimate runs every step over every sequence; when k = 0 wins by a wide
margin (drafts would cost over a fifth of the throughput) it is redone only every `QUIET_STEPS` + 1
steps, and at batches of `QUIET_BATCH` or more, where an estimate costs the host a fraction of a
millisecond (0.6 ms at 256 sequences on the H100's host), every `QUIET_STEPS_LARGE_BATCH` + 1, a wait
that doubles while the answer stays 0 (up to `MAX_QUIET_STEPS_LARGE_BATCH` + 1) and ends when the batch
shrinks below `QUIET_BATCH`. Likewise, when every draft wins by over a quarter on measured costs, that
answer stands for `SURE_STEPS` more steps while the batch keeps its size.

The n-gram proposer runs here (it needs only token ids). It does not wait for the step in flight: a
sequence whose newest token is still being sampled gets the continuation of the latest match of the
tokens before it, minus the match's first token, which stands for the one in flight (if the guess is
wrong the drafts are rejected: verification keeps the output exact). So a lookup that finds nothing costs
nothing, and a step that may speculate keeps the overlap of host and device work; the step after a verify
step waits for it (its token count is known only then) unless `chains` lets it guess that every draft is
accepted (a rule that weighs the host gap it saves against the step it may waste). The cost of k > 0 is
therefore the plain step's plus, weighted by the chance that any sequence proposes, the verify step's
extra. A device proposer (draft model) gets placeholders (-1) that the runner fills in; requests with
penalties do not speculate with it (the penalties of a verified position count the drafts before it,
which are not on the host).
"""
from __future__ import annotations

import bisect
import math
import statistics
from array import array
from collections import deque
from dataclasses import dataclass, field

from minivllm.core.interfaces import SchedulerOutput
from minivllm.core.sequence import Sequence
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.ngram import NgramProposer, token_history

_PRIOR_WEIGHT = 2.0      # pseudo-counts of the global acceptance rate in each sequence's estimate
_NO_COUNTS = (0, 0, 0, 0)
_COST_WINDOW = 8         # recent step times kept per bucket (their median is the cost: compiles are outliers)
EXPLORE_EVERY = 32       # steps of plain decoding before speculation is tried again ...
MAX_EXPLORE_EVERY = 4096  # ... doubling after each try that does not pay, up to this
EXPLORE_SEQS = 4          # sequences that speculate in such a try
# k = 0 because drafts would cost > 20% of throughput: decide again in 3 steps; at a batch where one estimate
# costs the host more than 0.1 ms, in 7, then 15, then 31 while the answer stays 0 (and at once if the
# batch shrinks below that size).
QUIET_MARGIN, QUIET_STEPS = 0.8, 3
QUIET_BATCH, QUIET_STEPS_LARGE_BATCH, MAX_QUIET_STEPS_LARGE_BATCH = 32, 7, 31
# Every draft because they gain over a quarter on measured costs: keep that for 3 more steps while the batch
# keeps its size (at batch 1 on SmolLM2 a decision cost 40 us of a 1.2 ms verify step on the H100's host).
SURE_MARGIN, SURE_STEPS = 1.25, 3


def _decodes(seq: Sequence) -> bool:
    """Past its prompt: this step computes at most its newest token."""
    return seq.num_computed_tokens >= seq.num_total_tokens - 1


@dataclass
class SpecDecodeStats:
    """Counters as vLLM names them (minivllm:spec_decode_*)."""
    num_drafts: int = 0            # verifications (one per speculating sequence per step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


def _bucket(num_tokens: int) -> int:
    return 1 << max(0, num_tokens - 1).bit_length()


def _record(windows: dict[int, deque], medians: dict[int, float], bucket: int, value: float,
            buckets: list[int]) -> None:
    """Add `value` to its bucket's window of recent values and refresh that bucket's median (`buckets`:
    the measured buckets, kept sorted)."""
    window = windows.get(bucket)
    if window is None:
        window = windows[bucket] = deque(maxlen=_COST_WINDOW)
        bisect.insort(buckets, bucket)
    window.append(value)
    medians[bucket] = statistics.median(window)


class SpeculationController:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.reset_stats()
        self._seq_counts: dict[int, tuple[int, int, int, int]] = {}  # seq_id -> (accepted, rejected, proposed, tries)
        self._plain_cost: dict[int, deque] = {}              # token bucket -> recent seconds, steps without drafts
        self._spec_extra: dict[int, deque] = {}              # sequence bucket -> verify steps' extra seconds
        # Their medians, kept up to date as steps are observed, and the measured buckets in order: choose_k
        # reads them for every k of every step (at batch 1 its host time is a visible share of a step).
        self._plain_median: dict[int, float] = {}
        self._extra_median: dict[int, float] = {}
        self._plain_buckets: list[int] = []
        self._extra_buckets: list[int] = []
        self._histories: dict[int, array] = {}               # seq_id -> its token ids, for n-gram lookups
        self._num_accepted = self._num_rejections = self._num_proposed = self._num_tries = 0
        self._plain_steps, self._explore_every = 0, EXPLORE_EVERY
        self._exploring, self._explore_offset = False, 0
        self._quiet_steps = 0
        self._quiet_large, self._quiet_large_steps = False, QUIET_STEPS_LARGE_BATCH
        self._sure_steps, self._sure_batch = 0, 0
        self.num_proposed_behind = 0   # proposals made while the sequence's newest token was in flight
        self._fully_accepted: set[int] = set()   # sequences whose last verification accepted every draft
        self._full_after = {True: [0, 0], False: [0, 0]}   # (fully accepted, verifications) after one that was (not)
        self._host_gaps: deque = deque(maxlen=_COST_WINDOW)   # device idle after an unchained verify step
        self._host_gap: float | None = None
        self.num_chained_steps = 0     # steps launched behind a verify step before it was read back

    def reset_stats(self) -> None:
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.max_k)

    # ---- decisions ---------------------------------------------------------------------------------
    def _cap(self, seq: Sequence) -> int:
        """Most drafts `seq` may take: every token of a verify step may be kept, so stay inside its limits."""
        params = seq.group.sampling_params
        total = len(seq.token_ids) + seq.num_pending_tokens   # (attributes, not properties: choose_k runs
        cap = min(self.max_k, self.max_model_len - total - 1)  # this for every sequence every step)
        if params.max_tokens is not None:
            cap = min(cap, params.max_tokens - (total - seq.num_prompt_tokens) - 1)
        if self.ngram is None and params.uses_penalties:
            return 0
        return max(cap, 0)

    def rates(self, seqs: list[Sequence]) -> tuple[list[float], list[float]]:
        """Each sequence's acceptance rate per draft and proposal rate (the share of its tries in which the
        proposer had anything), its counts with `_PRIOR_WEIGHT` pseudo-counts of the global rates."""
        prior_accepted = _PRIOR_WEIGHT * (self._num_accepted + 1) / (self._num_accepted + self._num_rejections + 2)
        prior_proposed = _PRIOR_WEIGHT * (self._num_proposed + 1) / (self._num_tries + 2)
        counts = [self._seq_counts.get(s.seq_id, _NO_COUNTS) for s in seqs]
        return ([(accepted + prior_accepted) / (accepted + rejected + _PRIOR_WEIGHT)
                 for accepted, rejected, _, _ in counts],
                [(proposed + prior_proposed) / (tries + _PRIOR_WEIGHT) for _, _, proposed, tries in counts])

    def plain_cost(self, num_tokens: int) -> float | None:
        """The median recent cost of plain steps in the largest measured bucket up to `num_tokens`."""
        i = bisect.bisect_right(self._plain_buckets, _bucket(num_tokens))
        return self._plain_median[self._plain_buckets[i - 1]] if i else None

    def _plain_cost_at(self, num_tokens: int) -> float | None:
        """Plain steps' cost interpolated at `num_tokens`: affine between the measured buckets around it
        (prefill chunks included), or the bucket below when none is above."""
        buckets, medians = self._plain_buckets, self._plain_median
        i = bisect.bisect_right(buckets, _bucket(num_tokens))
        if not i:
            return None
        low = buckets[i - 1]
        if i == len(buckets):
            return medians[low]
        high = buckets[i]
        return medians[low] + (medians[high] - medians[low]) * (num_tokens - low) / (high - low)

    def _verify_extra(self, num_seqs: int) -> float | None:
        """What verifying adds to a plain step of the same size: the median extra over the plain estimate
        of recent verify steps of about as many sequences (the nearest measured bucket; None before any).
        The extra is mostly host work per sequence that waits for the result, not per draft: keyed by
        tokens, the draft lengths of one batch fell into different buckets whose few samples (chained
        verify steps cost little, unchained ones a host step more) made k = 3 look cheaper than k = 5 at
        random. So a try by a few sequences of a large batch prices the whole batch's verify step only by
        its extra, the tokens being priced as a plain step."""
        if not self._extra_buckets:
            return None
        bits = _bucket(num_seqs).bit_length()
        nearest = min(self._extra_buckets, key=lambda b: (abs(b.bit_length() - bits), b))
        return max(0.0, self._extra_median[nearest])

    def _estimated_verify_cost(self, num_tokens: int, num_seqs: int) -> float | None:
        """A plain step of `num_tokens` plus `_verify_extra(num_seqs)`."""
        plain = self._plain_cost_at(num_tokens)
        extra = self._verify_extra(num_seqs)
        return plain if plain is None or extra is None else plain + extra

    def choose_k(self, running: list[Sequence]) -> int:
        """The draft length for this step's speculating sequences (0: plain decoding)."""
        if not any(map(_decodes, running)):
            return 0   # nobody decodes (the first sequence usually does: no pass over the batch)
        if not self.config.adaptive:
            return self.max_k
        if self._quiet_steps and self._quiet_large and len(running) < QUIET_BATCH:
            self._quiet_steps = 0   # the batch the quiet period was chosen for is gone: decide again now
        if self._quiet_steps:   # off by a wide margin last time: its inputs move slowly, so skip a few
            self._quiet_steps -= 1
            return self._plain_step()
        if self._sure_steps and len(running) == self._sure_batch:   # likewise, every draft by a wide margin
            self._sure_steps -= 1
            return self.max_k
        decoding = [s for s in running if _decodes(s)]
        rates, hits = self.rates(decoding)
        caps = [self._cap(s) for s in decoding]
        plain_cost = self.plain_cost(len(running)) or 1.0
        best_k, best_rate = 0, len(decoding) / plain_cost
        best_speculative = 0.0
        # A lookup that finds nothing leaves a plain step (n-gram: no wait for the step in flight).
        any_proposes = 1.0 - math.prod(1.0 - h for h in hits) if self.proposes_behind(running) else 1.0
        self._exploring = False
        # E[tokens](k) = sum over sequences of 1 + h (a + a^2 + ... + a^min(k, cap)): one more power per k.
        terms, expected, num_tokens = hits, float(len(decoding)), len(running)
        extra = self._verify_extra(len(running)) or 0.0
        for k in range(1, self.max_k + 1):
            terms = [t * a if c >= k else 0.0 for t, a, c in zip(terms, rates, caps)]
            expected += sum(terms)
            num_tokens += sum(c >= k for c in caps)
            plain = self._plain_cost_at(num_tokens)
            verify_cost = max(0.0 if plain is None else plain + extra, plain_cost)
            cost = plain_cost + any_proposes * (verify_cost - plain_cost)
            # Drafts must earn a clear gain: lookups cost host time (11 ms a step for 256 sequences on
            # the H100's host), and as proposals get rare both the gain and the verify steps' share of
            # the cost go to 0, which without a margin would keep every sequence looking.
            best_speculative = max(best_speculative, expected / cost)
            if expected / cost > best_rate * 1.02:
                best_k, best_rate = k, expected / cost
        if best_k:
            self._plain_steps, self._explore_every = 0, EXPLORE_EVERY
            self._quiet_large_steps = QUIET_STEPS_LARGE_BATCH
            measured = self._extra_buckets and self._plain_buckets   # not the optimistic start
            if best_k == self.max_k and measured and best_rate > SURE_MARGIN * len(decoding) / plain_cost:
                self._sure_steps, self._sure_batch = SURE_STEPS, len(running)
            return best_k
        self._quiet_large = len(decoding) >= QUIET_BATCH
        if self._quiet_large:
            self._quiet_steps = self._quiet_large_steps
            self._quiet_large_steps = min(2 * self._quiet_large_steps + 1, MAX_QUIET_STEPS_LARGE_BATCH)
        elif best_speculative < QUIET_MARGIN * best_rate:
            self._quiet_steps = QUIET_STEPS
        return self._plain_step()

    def _plain_step(self) -> int:
        """k = 0, or every `_explore_every` such steps a try with every draft."""
        self._plain_steps += 1
        if self._plain_steps >= self._explore_every:
            self._plain_steps = 0
            self._explore_every = min(2 * self._explore_every, MAX_EXPLORE_EVERY)
            self._exploring = True
            return self.max_k
        return 0

    def proposes_behind(self, running: list[Sequence]) -> bool:
        """Whether this step's proposals need no wait for the step in flight: host n-gram lookups, unless a
        request checks drafts against a grammar or samples with a seed (its drafts, and so its random
        draws, must depend on its tokens alone, not on what else is in the batch)."""
        return self.ngram is not None and not any(
            s.sampling_params.structured_outputs is not None
            or (s.sampling_params.seed is not None and not s.sampling_params.greedy) for s in running)

    def chains(self, scheduled: SchedulerOutput) -> bool:
        """Whether the step after `scheduled` (a verify step) may be scheduled and launched before it is read
        back, as if every draft were accepted (every verifying sequence's proposals must need no wait).

        Not chaining leaves the device idle while the host reads the result back and prepares the next
        step: the measured host gap G. Chaining saves G when every draft is accepted; when not, the step
        launched behind is discarded for the sequences that rejected, and the next real step waits for it
        on the device, which costs max(0, D - G) with D a plain step's cost (the host prepares the real
        step meanwhile). So chain when (1 - p) max(0, D - G) < p G, p the chance that all drafts are
        accepted given the sequence's last verification (measured: copying runs on). At batch 1 on a
        small model D is about G and nearly every verify step chains; on a large one D >> G and only
        runs of accepted drafts do. Until G is measured: chain after a fully accepted verification."""
        verifying = [seq for seq, drafts in zip(scheduled.seqs, scheduled.spec_token_ids) if drafts]
        if not all(self.proposes_behind([seq]) for seq in verifying):
            return False
        plain_cost = self.plain_cost(len(scheduled.seqs))
        if self._host_gap is None or plain_cost is None:
            return all(seq.seq_id in self._fully_accepted for seq in verifying)
        p = sum(self.full_acceptance_rate(seq.seq_id in self._fully_accepted) for seq in verifying) / len(verifying)
        return (1.0 - p) * max(0.0, plain_cost - self._host_gap) < p * self._host_gap

    def full_acceptance_rate(self, last_fully_accepted: bool) -> float:
        """The share of verifications that accepted every draft, after one that did (or did not)."""
        full, total = self._full_after[last_fully_accepted]
        return (full + 1) / (total + 2)

    def propose(self, running: list[Sequence], k: int) -> int:
        """Set `spec_token_ids` on the running sequences that speculate now; returns how many do."""
        if k == 0:   # most steps under load: only last step's drafts to clear
            for seq in running:
                if seq.spec_token_ids:
                    seq.spec_token_ids = []
            return 0
        count = 0
        trying = None
        if self._exploring and len(running) > EXPLORE_SEQS:   # a try: a few sequences, in turn
            start = self._explore_offset % len(running)
            trying = {id(s) for s in (running[start:] + running[:start])[:EXPLORE_SEQS]}
            self._explore_offset += EXPLORE_SEQS
        for seq in running:
            if seq.spec_token_ids:
                seq.spec_token_ids = []
            # 1: its newest token is still in flight, maybe behind the drafts of a verify step in flight
            behind = seq.num_pending_tokens - len(seq.drafts_in_flight)
            if (behind > 1 or seq.num_computed_tokens != seq.num_tokens - 1 + seq.num_pending_tokens
                    or seq.num_pending_forks or (trying is not None and id(seq) not in trying)):
                continue
            if behind and not self.proposes_behind([seq]):
                continue
            cap = min(k, self._cap(seq))
            if self.ngram is not None:
                history = self._history(seq)
                if seq.drafts_in_flight:
                    history = history + token_history(seq.drafts_in_flight)
                seq.spec_token_ids = (self.ngram.propose(history, cap + 1)[1:] if behind
                                      else self.ngram.propose(history, cap))
                self.num_proposed_behind += bool(behind and seq.spec_token_ids)
                if cap:
                    self._count(seq, tried=True, proposed=bool(seq.spec_token_ids))
            else:
                seq.spec_token_ids = [-1] * cap
            count += bool(seq.spec_token_ids)
        return count

    def _history(self, seq: Sequence) -> array:
        """`seq`'s token ids as an n-gram history, extended by the tokens appended since the last lookup
        (a running sequence's tokens are only ever appended)."""
        history = self._histories.get(seq.seq_id)
        tokens = seq.token_ids
        if history is None or len(history) > len(tokens):
            history = self._histories[seq.seq_id] = token_history(tokens)
        elif len(history) < len(tokens):
            history.extend(tokens[len(history):])
        return history

    # ---- feedback ----------------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, num_seqs: int, seconds: float, speculative: bool) -> None:
        if not speculative:
            _record(self._plain_cost, self._plain_median, _bucket(num_tokens), seconds, self._plain_buckets)
            return
        plain = self._plain_cost_at(num_tokens)
        if plain is not None:
            _record(self._spec_extra, self._extra_median, _bucket(num_seqs), seconds - plain, self._extra_buckets)

    def observe_host_gap(self, seconds: float) -> None:
        """Host time from reading an unchained verify step back to launching the next step (the device idles)."""
        self._host_gaps.append(seconds)
        self._host_gap = statistics.median(self._host_gaps)

    def observe_verification(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            stats.accepted_per_position[j] += 1
        full, last_full = num_accepted == num_drafts, seq.seq_id in self._fully_accepted
        self._full_after[last_full][0] += full
        self._full_after[last_full][1] += 1
        if full:
            self._fully_accepted.add(seq.seq_id)
        else:
            self._fully_accepted.discard(seq.seq_id)
        self._count(seq, num_accepted, rejected=num_accepted < num_drafts, tried=self.ngram is None,
                    proposed=self.ngram is None)

    def _count(self, seq: Sequence, num_accepted: int = 0, rejected: bool = False, tried: bool = False,
               proposed: bool = False) -> None:
        accepted, rejections, proposals, tries = self._seq_counts.get(seq.seq_id, (0, 0, 0, 0))
        self._num_accepted += num_accepted
        self._num_rejections += rejected
        self._num_proposed += proposed
        self._num_tries += tried
        self._seq_counts[seq.seq_id] = (accepted + num_accepted, rejections + rejected, proposals + proposed,
                                        tries + tried)

    def forget(self, seq_id: int) -> None:
        self._seq_counts.pop(seq_id, None)
        self._histories.pop(seq_id, None)
        self._fully_accepted.discard(seq_id)
