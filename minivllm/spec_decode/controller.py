"""Which running sequences speculate in the next step, and with how many drafts (host side, no torch).

Adaptive speculation: before each step the controller picks one draft length k for the batch (0 means
plain decoding) to maximise expected tokens per second:

    E[tokens](k) = sum over sequences of (1 - a^(k+1)) / (1 - a)     (a: that sequence's acceptance rate)
    cost(k)      = measured wall time of a step computing B * (1 + k) tokens (B running sequences)

Acceptance rates are per sequence (accepted / (accepted + rejected), with a prior from all sequences);
step costs are kept per power-of-two bucket of scheduled tokens and learned as the engine runs. A bucket
never measured is assumed to cost what the nearest smaller measured one does, so each is tried once and
then judged on its measured cost: at high load a verify step costs nearly (1 + k) decode steps and k
falls to 0 by itself.

The n-gram proposer runs here (it needs only token ids). A device proposer (draft model) gets
placeholders (-1) that the runner fills in; requests with penalties do not speculate with it (the
penalties of a verified position count the drafts before it, which are not on the host).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.core.sequence import Sequence
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.ngram import NgramProposer

_PRIOR_WEIGHT = 2.0      # pseudo-counts of the global acceptance rate in each sequence's estimate
_COST_SMOOTHING = 0.2    # weight of a new measurement in a bucket's running cost


@dataclass
class SpecDecodeStats:
    """Counters as vLLM names them (minivllm:spec_decode_*)."""
    num_drafts: int = 0            # verifications (one per speculating sequence per step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


def _bucket(num_tokens: int) -> int:
    return 1 << max(0, num_tokens - 1).bit_length()


class SpeculationController:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.max_k)
        self._seq_counts: dict[int, tuple[int, int]] = {}   # seq_id -> (accepted, rejected)
        self._step_cost: dict[int, float] = {}               # token bucket -> seconds
        self._num_rejections = 0

    # ---- decisions ---------------------------------------------------------------------------------
    def _cap(self, seq: Sequence) -> int:
        """Most drafts `seq` may take: every token of a verify step may be kept, so stay inside its limits."""
        params = seq.sampling_params
        cap = min(self.max_k, self.max_model_len - seq.num_total_tokens - 1)
        if params.max_tokens is not None:
            cap = min(cap, params.max_tokens - seq.num_output_tokens - seq.num_pending_tokens - 1)
        if self.ngram is None and params.uses_penalties:
            return 0
        return max(cap, 0)

    def acceptance_rate(self, seq: Sequence) -> float:
        stats = self.stats
        global_rate = (stats.num_accepted_tokens + 1) / (stats.num_accepted_tokens + self._num_rejections + 2)
        accepted, rejected = self._seq_counts.get(seq.seq_id, (0, 0))
        return (accepted + _PRIOR_WEIGHT * global_rate) / (accepted + rejected + _PRIOR_WEIGHT)

    def step_cost(self, num_tokens: int) -> float | None:
        bucket = _bucket(num_tokens)
        known = [b for b in self._step_cost if b <= bucket]
        return self._step_cost[max(known)] if known else None

    def choose_k(self, running: list[Sequence]) -> int:
        """The draft length for this step's speculating sequences (0: plain decoding)."""
        decoding = [s for s in running if s.num_computed_tokens >= s.num_total_tokens - 1]
        if not decoding:
            return 0
        if not self.config.adaptive:
            return self.max_k
        rates = [min(self.acceptance_rate(s), 0.999) for s in decoding]
        caps = [self._cap(s) for s in decoding]
        best_k, best_rate = 0, None
        for k in range(self.max_k + 1):
            cost = self.step_cost(len(running) + sum(min(k, c) for c in caps))
            if cost is None:
                cost = self.step_cost(len(running)) or 1.0
            expected = sum((1 - a ** (min(k, c) + 1)) / (1 - a) for a, c in zip(rates, caps))
            rate = expected / cost
            if best_rate is None or rate > best_rate * 1.02:  # longer drafts must earn a clear gain
                best_k, best_rate = k, rate
        return best_k

    def propose(self, running: list[Sequence], k: int) -> int:
        """Set `spec_token_ids` on the running sequences that speculate now; returns how many do."""
        count = 0
        for seq in running:
            seq.spec_token_ids = []
            if (k == 0 or seq.num_pending_tokens or seq.num_computed_tokens != seq.num_tokens - 1
                    or seq.num_pending_forks):
                continue
            cap = min(k, self._cap(seq))
            if self.ngram is not None:
                seq.spec_token_ids = self.ngram.propose(seq.token_ids, cap)
            else:
                seq.spec_token_ids = [-1] * cap
            count += bool(seq.spec_token_ids)
        return count

    # ---- feedback ----------------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        bucket = _bucket(num_tokens)
        old = self._step_cost.get(bucket)
        self._step_cost[bucket] = seconds if old is None else (1 - _COST_SMOOTHING) * old + _COST_SMOOTHING * seconds

    def observe_verification(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            stats.accepted_per_position[j] += 1
        accepted, rejected = self._seq_counts.get(seq.seq_id, (0, 0))
        self._num_rejections += num_accepted < num_drafts
        self._seq_counts[seq.seq_id] = (accepted + num_accepted, rejected + (num_accepted < num_drafts))

    def forget(self, seq_id: int) -> None:
        self._seq_counts.pop(seq_id, None)
