"""Which running sequences speculate in the next step, and with how many drafts (host side, no torch).

Adaptive speculation, per sequence: before each step the controller gives each decoding sequence a draft
length k_i (0 for most under load) to maximise expected tokens per second:

    E[tokens] = sum over sequences of 1 + h_i * (a_i + a_i^2 + ... + a_i^k_i)
    cost      = plain step + P(any sequence proposes) * (verify step of B + sum k_i tokens - plain step)

with a_i the sequence's acceptance rate per draft (accepted / (accepted + rejected)) and h_i the share of
its tries in which the proposer had anything to propose (lookups often find nothing), each with a prior
from all sequences; costs come from `StepCosts` (core/step_costs.py), measured on the device. The j-th
draft of sequence i gains h_i a_i^j tokens, so the drafts of all sequences are taken in order of that gain
and the best prefix of that order wins: at batch 1, where a verify step costs about a plain one, every
likely draft goes; at a larger batch only the sequences whose drafts are accepted often enough to pay for
their verify rows do; and when no prefix beats plain decoding by 2%, nobody speculates. While nobody does,
speculation is tried again after `EXPLORE_EVERY` plain steps, by `EXPLORE_SEQS` sequences (in turn): a
try costs a few tokens, not a verify step of the whole batch (at 256 x 512 -> 256 on an H100, whole-batch
tries cost 4.6% of throughput). Each try that does not switch speculation back on doubles the wait (up to
`MAX_EXPLORE_EVERY`), so a proposer that never pays costs almost nothing.

Zero cost when drafts do not pay: the estimate runs over every sequence, and while nobody speculates
its inputs (measured costs and acceptance) do not change, so a k = 0 answer is kept for `QUIET_STEPS`
steps, at batches of `QUIET_BATCH` or more (where an estimate costs the host a fraction of a millisecond:
0.6 ms at 256 sequences on the H100's host) for `QUIET_STEPS_LARGE_BATCH`, a wait that doubles while the
answer stays 0 (up to `MAX_QUIET_STEPS`). The wait ends early when the batch it was chosen for is gone:
a small batch that changes size, or a large one that shrinks below `QUIET_BATCH`, and when a try brings
new measurements. A quiet step and a k = 0 `propose` touch no sequence (only those given drafts the step
before). Likewise every draft for every sequence, once costs are measured, stands for `HELD_STEPS` more steps
while the batch keeps its size, a wait that doubles while the estimate repeats it (up to `MAX_HELD_STEPS`): at
batch 1 most steps of a speculating run are plain ones whose lookup found nothing, and with an estimate before
each they took 0.628 ms of engine time against off's 0.539 on an H200, 0.553 with it held (`real_traced` in
bench/results/spec_decode_h200.json).

Host proposers (n-gram, suffix) run here (they need only token ids). They do not wait for the step in
flight: a sequence whose newest token is still being sampled gets the continuation of the tokens before
it, minus its first token, which stands for the one in flight (if the guess is wrong the drafts are
rejected: verification keeps the output exact). So a lookup that finds nothing costs nothing, and a step
that may speculate keeps the overlap of host and device work; the step after a verify step waits for it
(its token count is known only then) unless `chains` lets it guess that every draft is accepted (a rule
that weighs the host gap it saves against the step it may waste). A device proposer (draft model) gets
placeholders (-1) that the runner fills in; requests with penalties do not speculate with it (the
penalties of a verified position count the drafts before it, which are not on the host).
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

from minivllm.core.interfaces import SchedulerOutput
from minivllm.core.sequence import Sequence
from minivllm.core.step_costs import StepCosts
from minivllm.spec_decode.chaining import ChainPolicy
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.ngram import NgramProposer, token_history
from minivllm.spec_decode.suffix import SuffixProposer

_PRIOR_WEIGHT = 2.0      # pseudo-counts of the global acceptance rate in each sequence's estimate
_NO_COUNTS = (0, 0, 0, 0)
EXPLORE_EVERY = 32       # steps of plain decoding before speculation is tried again ...
MAX_EXPLORE_EVERY = 4096  # ... doubling after each try that does not pay, up to this
EXPLORE_SEQS = 4          # sequences that speculate in such a try
# k = 0: decide again in 3 steps, then 7, 15, 31 while the answer stays 0; at a batch where one estimate
# costs the host more than 0.1 ms, in 7, then 15, then 31.
QUIET_STEPS, QUIET_BATCH, QUIET_STEPS_LARGE_BATCH, MAX_QUIET_STEPS = 3, 32, 7, 31
# Every draft on measured costs: keep that for 3 more steps while the batch keeps its size, then 7, 15, 31
# while the estimate repeats it (at batch 1 on SmolLM2 an estimate cost 40 us of a 1.2 ms verify step on the
# H100's host).
HELD_STEPS, MAX_HELD_STEPS = 3, 31
# Draft positions priced one by one up to this many per estimate, then in evenly spaced groups (at 256
# sequences x 7 drafts, pricing each would cost the host milliseconds).
MAX_PRICED_PREFIXES = 64


def _decodes(seq: Sequence) -> bool:
    """Past its prompt: this step computes at most its newest token."""
    return seq.num_computed_tokens >= seq.num_total_tokens - 1


class _KeptDecision:
    """A decision kept, instead of estimated again, for `steps` more steps at the batch size it was made for. Made
    again as soon as it ends (at that batch, where `keep` says so), it is kept twice as long plus one, up to `most`."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.steps = self.batch = self.wait = 0

    def keep(self, batch: int, first: int, again_at_same_batch_only: bool) -> None:
        again = self.wait and (self.batch == batch or not again_at_same_batch_only)
        self.wait = min(2 * self.wait + 1, self.most) if again else first
        self.steps, self.batch = self.wait, batch

    def forget(self) -> None:
        """The next `keep` starts again from its first wait."""
        self.wait = 0


@dataclass
class SpecDecodeStats:
    """Counters as vLLM names them (minivllm:spec_decode_*)."""
    num_drafts: int = 0            # verifications (one per speculating sequence per step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


def _host_proposer(config: SpeculativeConfig) -> NgramProposer | SuffixProposer | None:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob,
                              config.suffix_decoding_min_cache_match)
    return None


class SpeculationController:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.host_proposer = _host_proposer(config)   # None: a draft model on the device
        self.suffix = self.host_proposer if isinstance(self.host_proposer, SuffixProposer) else None
        self.reset_stats()
        self.costs = StepCosts()
        self._seq_counts: dict[int, tuple[int, int, int, int]] = {}  # seq_id -> (accepted, rejected, proposed, tries)
        self._histories: dict[int, array] = {}               # seq_id -> its token ids, for host lookups
        self._plan: dict[int, int] | None = None             # seq_id -> drafts this step (None: up to k for all)
        self._drafted: list[Sequence] = []                   # sequences given drafts by the last `propose`
        self._num_accepted = self._num_rejections = self._num_proposed = self._num_tries = 0
        self._plain_steps, self._explore_every = 0, EXPLORE_EVERY
        self._exploring, self._explore_offset = False, 0
        self._quiet = _KeptDecision(MAX_QUIET_STEPS)   # k = 0, kept
        self._held = _KeptDecision(MAX_HELD_STEPS)     # every draft, kept
        self.num_proposed_behind = 0   # proposals made while the sequence's newest token was in flight
        self.chaining = ChainPolicy()
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
        if self.host_proposer is None and params.uses_penalties:
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

    def choose_k(self, running: list[Sequence]) -> int:
        """Plan this step's drafts per sequence (`propose` follows the plan); returns the most any sequence
        takes (0: plain decoding)."""
        if not any(map(_decodes, running)):
            return 0   # nobody decodes (the first sequence usually does: no pass over the batch)
        self._plan = None
        if not self.config.adaptive:
            return self.max_k
        quiet, held = self._quiet, self._held
        if quiet.steps and (len(running) < QUIET_BATCH <= quiet.batch or (
                quiet.batch < QUIET_BATCH and len(running) != quiet.batch)):
            quiet.steps = 0   # the batch the quiet period was chosen for is gone: decide again now
        if quiet.steps:   # off last time, and nothing measured since: skip a few
            quiet.steps -= 1
            return self._plain_step()
        if held.steps:   # likewise, every draft, unless the batch changed size
            if len(running) == held.batch:
                held.steps -= 1
                return self.max_k
            held.steps = 0
        decoding = [s for s in running if _decodes(s)]
        plan = self._plan_drafts(running, decoding)
        self._exploring = False
        if plan:
            self._plain_steps, self._explore_every = 0, EXPLORE_EVERY
            quiet.forget()
            every_draft = len(plan) == len(decoding) and all(k == self.max_k for k in plan.values())
            self._plan = None if every_draft else plan
            if every_draft and self.costs.measured:   # (a plan per sequence would miss a sequence that joins)
                held.keep(len(running), HELD_STEPS, again_at_same_batch_only=True)
            else:
                held.forget()
            return max(plan.values())
        held.forget()
        quiet.keep(len(running), QUIET_STEPS_LARGE_BATCH if len(decoding) >= QUIET_BATCH else QUIET_STEPS,
                   again_at_same_batch_only=False)
        return self._plain_step()

    def _plan_drafts(self, running: list[Sequence], decoding: list[Sequence]):
        """The drafts per sequence that maximise expected tokens per second: draft j of sequence i gains
        h_i a_i^j tokens, so drafts are taken in order of that gain and the best prefix wins if it beats
        plain decoding by 2%. Returns the plan: {seq_id: drafts}, empty for plain decoding."""
        rates, hits = self.rates(decoding)
        caps = [self._cap(s) for s in decoding]
        plain_cost = self.costs.plain(len(running)) or 1.0
        plain_rate = len(decoding) / plain_cost
        behind = self.proposes_behind(running)   # a lookup that finds nothing leaves a plain step
        extra = self.costs.verify_extra(len(running)) or 0.0
        drafts = []
        for i, (a, h, cap) in enumerate(zip(rates, hits, caps)):
            gain = h
            for _ in range(cap):
                gain *= a
                drafts.append((gain, i))
        drafts.sort(key=lambda d: -d[0])   # stable: a sequence's drafts stay in order
        group = max(1, math.ceil(len(drafts) / MAX_PRICED_PREFIXES))
        expected, num_tokens, no_proposal = float(len(decoding)), len(running), 1.0
        ks = [0] * len(decoding)
        best_n, best_rate = 0, plain_rate
        for n, (gain, i) in enumerate(drafts, 1):
            expected += gain
            num_tokens += 1
            if not ks[i] and behind:
                no_proposal *= 1.0 - hits[i]
            ks[i] += 1
            if n % group and n != len(drafts):
                continue
            plain = self.costs.plain_at(num_tokens)
            verify_cost = max(0.0 if plain is None else plain + extra, plain_cost)
            cost = plain_cost + (1.0 - no_proposal if behind else 1.0) * (verify_cost - plain_cost)
            # Drafts must earn a clear gain: lookups cost host time, and as proposals get rare both the gain
            # and the verify steps' share of the cost go to 0, which without a margin would keep every
            # sequence looking (at 256 x 512 -> 256 on an H100: 0.93x and 0.89x of plain decoding).
            if expected / cost > max(best_rate, 1.02 * plain_rate):
                best_n, best_rate = n, expected / cost
        plan: dict[int, int] = {}
        for _, i in drafts[:best_n]:
            seq_id = decoding[i].seq_id
            plan[seq_id] = plan.get(seq_id, 0) + 1
        return plan

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
        """Whether this step's proposals need no wait for the step in flight: host lookups, unless a
        request checks drafts against a grammar or samples with a seed (its drafts, and so its random
        draws, must depend on its tokens alone, not on what else is in the batch)."""
        return self.host_proposer is not None and not any(
            s.sampling_params.structured_outputs is not None
            or (s.sampling_params.seed is not None and not s.sampling_params.greedy) for s in running)

    def chains(self, scheduled: SchedulerOutput) -> bool:
        """Whether the step after `scheduled` (a verify step) may be scheduled and launched before it is read
        back, as if every draft were accepted: only when every verifying sequence's proposals need no wait,
        and then as `ChainPolicy` (chaining.py) weighs it."""
        verifying = [seq for seq, drafts in zip(scheduled.seqs, scheduled.spec_token_ids) if drafts]
        if not all(self.proposes_behind([seq]) for seq in verifying):
            return False
        return self.chaining.chains([seq.seq_id for seq in verifying], self.costs.plain(len(scheduled.seqs)))

    def full_acceptance_rate(self, last_fully_accepted: bool) -> float:
        return self.chaining.full_acceptance_rate(last_fully_accepted)

    def propose(self, running: list[Sequence], k: int) -> int:
        """Set `spec_token_ids` on the running sequences that speculate now; returns how many do."""
        for seq in self._drafted:   # only these may still hold drafts (the scheduler takes the others')
            seq.spec_token_ids = []
        self._drafted = []
        if k == 0:   # most steps under load: no pass over the batch
            return 0
        plan = self._plan
        count = 0
        trying = None
        if self._exploring and len(running) > EXPLORE_SEQS:   # a try: a few sequences, in turn
            start = self._explore_offset % len(running)
            trying = {id(s) for s in (running[start:] + running[:start])[:EXPLORE_SEQS]}
            self._explore_offset += EXPLORE_SEQS
        for seq in running:
            cap = min(k, self._cap(seq)) if plan is None else min(plan.get(seq.seq_id, 0), self._cap(seq))
            if not cap:
                continue
            # 1: its newest token is still in flight, maybe behind the drafts of a verify step in flight
            behind = seq.num_pending_tokens - len(seq.drafts_in_flight)
            if (behind > 1 or seq.num_computed_tokens != seq.num_tokens - 1 + seq.num_pending_tokens
                    or seq.num_pending_forks or (trying is not None and id(seq) not in trying)):
                continue
            if behind and not self.proposes_behind([seq]):
                continue
            proposer = self.host_proposer
            if proposer is not None:
                history = self._history(seq)
                if seq.drafts_in_flight:
                    history = history + token_history(seq.drafts_in_flight)
                # Behind: the continuation's first token stands for the one in flight.
                seq.spec_token_ids = proposer.propose(history, cap, skip=1 if behind else 0)
                self.num_proposed_behind += bool(behind and seq.spec_token_ids)
                self._count(seq, tried=True, proposed=bool(seq.spec_token_ids))
            else:
                seq.spec_token_ids = [-1] * cap
            if seq.spec_token_ids:
                self._drafted.append(seq)
                count += 1
        return count

    def _history(self, seq: Sequence) -> array:
        """`seq`'s token ids as a lookup history, extended by the tokens appended since the last lookup
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
        self.costs.observe(num_tokens, num_seqs, seconds, speculative)
        if speculative:
            self._quiet.steps = 0   # a try measured: decide again

    def observe_idle_after_verify(self, seconds: float, waited: bool) -> None:
        self.chaining.observe_idle(seconds, waited)

    def observe_discarded_step(self, seconds: float) -> None:
        self.chaining.observe_discarded(seconds)

    def observe_verification(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        self._quiet.steps = 0   # new acceptance data: decide again
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            stats.accepted_per_position[j] += 1
        self.chaining.observe_verification(seq.seq_id, num_accepted == num_drafts)
        self._count(seq, num_accepted, rejected=num_accepted < num_drafts, tried=self.host_proposer is None,
                    proposed=self.host_proposer is None)

    def _count(self, seq: Sequence, num_accepted: int = 0, rejected: bool = False, tried: bool = False,
               proposed: bool = False) -> None:
        accepted, rejections, proposals, tries = self._seq_counts.get(seq.seq_id, (0, 0, 0, 0))
        self._num_accepted += num_accepted
        self._num_rejections += rejected
        self._num_proposed += proposed
        self._num_tries += tried
        self._seq_counts[seq.seq_id] = (accepted + num_accepted, rejections + rejected, proposals + proposed,
                                        tries + tried)

    def forget(self, seq_id: int, output_token_ids: list[int] | None = None) -> None:
        """Drop a finished or aborted sequence's state; its output (if given) goes to the suffix cache."""
        if self.suffix is not None and output_token_ids:
            self.suffix.add_output(output_token_ids)
        self._seq_counts.pop(seq_id, None)
        self._histories.pop(seq_id, None)
        self.chaining.forget(seq_id)
