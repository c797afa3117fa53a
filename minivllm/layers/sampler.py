"""Batched sampling: one row of logits per sequence to sample -> token ids (and logprobs), on the device.

Owns the per-step `SamplingMetadata` (per-row parameters as tensors, built once per step) and the pure
tensor functions of the pipeline, in vLLM's order:

    raw logprobs -> logit bias -> min_tokens -> penalties -> greedy argmax
                 -> temperature -> min-p -> top-k -> top-p -> exponential race

It must not touch sequences, the scheduler or the tokenizer: the model runner turns sequences into
`SamplingRow`s. `Sampler.forward` never syncs with the host, and per-row Python loops run only over
seeded rows (each needs its own generator state).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.rejection_sampler import SpecDecodeMetadata, greedy_verify, rejection_sample

# Probability mass this close to top_p counts as reaching it: fp32 softmax rounds each probability,
# and without slack a nucleus whose exact mass equals top_p would gain one token by rounding alone.
_TOP_P_SLACK = 1e-6
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One row of logits to sample, in plain Python (built by the model runner)."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sample_index: int = 0  # which of the request's n samples this row is (distinguishes seeded siblings)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters as tensors on the logits' device; None where no row uses a feature."""
    temperature: torch.Tensor | None           # [S] fp32, 1.0 on greedy rows; None when every row is greedy
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None           # [S] bool, only for batches mixing greedy and random rows
    top_k: torch.Tensor | None                 # [S] int64, vocab_size where off
    max_top_k: int                             # largest top_k (vocab_size when any row has it off)
    top_p: torch.Tensor | None                 # [S] fp32, 1.0 where off
    min_p: torch.Tensor | None                 # [S] fp32, 0.0 where off
    # Penalties only: (row index, token id) of every prompt / output token of the rows using them.
    prompt_tokens: tuple[torch.Tensor, torch.Tensor] | None
    output_tokens: tuple[torch.Tensor, torch.Tensor] | None
    presence_penalties: torch.Tensor | None    # [S] fp32
    frequency_penalties: torch.Tensor | None   # [S] fp32
    repetition_penalties: torch.Tensor | None  # [S] fp32
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None           # (rows, stop token ids) to ban
    seeded_rows: list[int]                     # random rows with a seed ...
    row_seeds: list[int]                       # ... and the generator seed of each for this step
    max_num_logprobs: int | None               # widest `logprobs` asked; None when no row asked
    num_rows: int = 0
    # Structured outputs: [S, ceil(V / 32)] int32, bit j of word w allows token 32 w + j (all ones on
    # unconstrained rows); set by the runner from the engine's grammars. None when no row is constrained.
    grammar_bitmask: torch.Tensor | None = None

    @property
    def modifies_logits(self) -> bool:
        """Whether bias, min_tokens or penalties change the logits before the greedy argmax."""
        return (self.logit_bias is not None or self.min_tokens_mask is not None
                or self.repetition_penalties is not None or self.grammar_bitmask is not None)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> SamplingMetadata:
        if all(_plain_greedy(params) for params in {id(row.params): row.params for row in rows}.values()):
            # Every row takes the argmax of its raw logits: nothing per row to stage. At batch 1 a verify step's 16
            # rows share one request's parameters, and the loop below was a fifth of the host's work for the step.
            return cls(temperature=None, all_greedy=True, all_random=False, greedy_mask=None, top_k=None,
                       max_top_k=vocab_size, top_p=None, min_p=None, prompt_tokens=None, output_tokens=None,
                       presence_penalties=None, frequency_penalties=None, repetition_penalties=None,
                       logit_bias=None, min_tokens_mask=None, seeded_rows=[], row_seeds=[], max_num_logprobs=None,
                       num_rows=len(rows))
        temperature, top_k, top_p, min_p = [], [], [], []
        presence, frequency, repetition = [], [], []
        greedy: list[bool] = []
        bias_rows, bias_ids, bias_values = [], [], []
        ban_rows, ban_ids = [], []
        seeded_rows, row_seeds = [], []
        max_num_logprobs: int | None = None
        uses_penalties = False
        for i, row in enumerate(rows):
            p = row.params
            greedy.append(p.greedy)
            # Greedy rows get neutral values: they take the argmax before temperature and filters.
            temperature.append(1.0 if p.greedy else p.temperature)
            top_k.append(min(p.top_k, vocab_size) if p.top_k > 0 and not p.greedy else vocab_size)
            top_p.append(1.0 if p.greedy else p.top_p)
            min_p.append(0.0 if p.greedy else p.min_p)
            presence.append(p.presence_penalty)
            frequency.append(p.frequency_penalty)
            repetition.append(p.repetition_penalty)
            uses_penalties |= p.uses_penalties
            if p.logit_bias:
                for token_id, value in p.logit_bias.items():
                    if not 0 <= token_id < vocab_size:
                        raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary "
                                         f"(size {vocab_size})")
                    bias_rows.append(i)
                    bias_ids.append(token_id)
                    bias_values.append(value)
            if row.num_output_tokens < p.min_tokens:
                # Ids past the logits' width can never be sampled, so they need no ban.
                stop_ids = [t for t in p.all_stop_token_ids if 0 <= t < vocab_size]
                ban_rows.extend([i] * len(stop_ids))
                ban_ids.extend(stop_ids)
            if p.seed is not None and not p.greedy:
                seeded_rows.append(i)
                row_seeds.append(_row_seed(p.seed, row.sample_index, row.num_output_tokens))
            if p.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs or 0, p.logprobs)

        all_greedy, all_random = all(greedy), not any(greedy)
        # One host -> device copy for all per-row floats; none at all for a plain greedy batch.
        floats = None if all_greedy and not uses_penalties else _to_device(
            torch.tensor([temperature, top_p, min_p, presence, frequency, repetition], dtype=torch.float32), device)
        max_top_k = max(top_k, default=vocab_size)

        def index_tensor(values: list[int]) -> torch.Tensor:
            return _to_device(torch.tensor(values, dtype=torch.int64), device)

        prompt_tokens = output_tokens = None
        if uses_penalties:
            # Token ids only for rows that use penalties; the others keep neutral penalty values.
            using = [r for r in rows if r.params.uses_penalties]
            row_ids = [i for i, r in enumerate(rows) if r.params.uses_penalties]
            prompt_tokens = _flat_tokens([r.prompt_token_ids for r in using], row_ids, device)
            output_tokens = _flat_tokens([r.output_token_ids for r in using], row_ids, device)
        return cls(
            temperature=floats[0] if floats is not None else None,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if all_greedy or all_random else _to_device(torch.tensor(greedy), device),
            top_k=index_tensor(top_k) if any(k < vocab_size for k in top_k) else None,
            max_top_k=max_top_k,
            top_p=floats[1] if floats is not None and any(p < 1.0 for p in top_p) else None,
            min_p=floats[2] if floats is not None and any(p > 0.0 for p in min_p) else None,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            presence_penalties=floats[3] if uses_penalties else None,
            frequency_penalties=floats[4] if uses_penalties else None,
            repetition_penalties=floats[5] if uses_penalties else None,
            logit_bias=(index_tensor(bias_rows), index_tensor(bias_ids),
                        _to_device(torch.tensor(bias_values, dtype=torch.float32), device)) if bias_rows else None,
            min_tokens_mask=(index_tensor(ban_rows), index_tensor(ban_ids)) if ban_rows else None,
            seeded_rows=seeded_rows,
            row_seeds=row_seeds,
            max_num_logprobs=max_num_logprobs,
            num_rows=len(rows),
        )


def _plain_greedy(params: SamplingParams) -> bool:
    """Whether a row with these parameters samples the argmax of its raw logits and asks for nothing else."""
    return (params.greedy and not params.logit_bias and not params.min_tokens and not params.uses_penalties
            and params.logprobs is None)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                  # [S] int64
    logprob_token_ids: torch.Tensor | None   # [S, 1 + max_num_logprobs] int64: chosen id, then the top ids
    logprobs: torch.Tensor | None            # [S, 1 + max_num_logprobs] fp32, raw (before any processing)
    ranks: torch.Tensor | None               # [S] int64 rank of the chosen token among raw logprobs (1 = best)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax; on CUDA the chunked kernel (one block per row in torch: 30 us at batch 1, 128k vocab)."""
    if logits.is_cuda:
        from minivllm.kernels.argmax import argmax_rows
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler(nn.Module):
    """Stateless apart from one reusable generator per device for seeded rows."""

    def __init__(self) -> None:
        super().__init__()
        self._generators: dict[torch.device, torch.Generator] = {}

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata,
                spec: SpecDecodeMetadata | None = None) -> SamplerOutput:
        """`logits` [S, V]; may be overwritten in place when they are already fp32.

        With `spec`, rows verifying draft tokens go through rejection sampling: a speculating sequence's
        rows then hold its accepted drafts, its corrected or bonus token, and -1 past that."""
        assert logits.dim() == 2 and logits.shape[0] == metadata.num_rows
        if metadata.all_greedy and metadata.max_num_logprobs is None and not metadata.modifies_logits:
            # Widening to fp32 is exact and monotonic, so the argmax of the raw logits is the same token.
            return SamplerOutput(self._verify(greedy_argmax(logits), None, spec), None, None, None)
        logits = logits.float()
        if metadata.grammar_bitmask is not None:  # first: what the grammar forbids is never a candidate
            logits = apply_token_bitmask(logits, metadata.grammar_bitmask)
        raw_logprobs = compute_logprobs(logits) if metadata.max_num_logprobs is not None else None

        if metadata.logit_bias is not None:
            logits = apply_logit_bias(logits, *metadata.logit_bias)
        if metadata.min_tokens_mask is not None:
            logits = apply_min_tokens(logits, *metadata.min_tokens_mask)
        if metadata.repetition_penalties is not None:
            logits = apply_penalties(logits, metadata.prompt_tokens, metadata.output_tokens,
                                     metadata.presence_penalties, metadata.frequency_penalties,
                                     metadata.repetition_penalties)

        greedy_tokens = None if metadata.all_random else greedy_argmax(logits)
        probs = None
        if metadata.all_greedy:
            token_ids = greedy_tokens
        else:
            logits = apply_temperature(logits, metadata.temperature)
            logits = apply_top_k_top_p_min_p(logits, metadata.top_k, metadata.top_p, metadata.min_p,
                                             max_k=metadata.max_top_k)
            probs = logits.softmax(dim=-1)
            noise = self._exponential_noise(probs, metadata)
            # random_sample overwrites its input; verification needs the distributions themselves.
            token_ids = random_sample(probs.clone() if spec is not None else probs, noise)
            if greedy_tokens is not None:
                token_ids = torch.where(metadata.greedy_mask, greedy_tokens, token_ids)
        token_ids = self._verify(token_ids, probs, spec)

        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        ids, values, ranks = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, token_ids.clamp_min(0))
        return SamplerOutput(token_ids, ids, values, ranks)

    @staticmethod
    def _verify(token_ids: torch.Tensor, probs: torch.Tensor | None,
                spec: SpecDecodeMetadata | None) -> torch.Tensor:
        """Replace the rows of speculating sequences by the outcome of verifying their drafts (unless the
        runner verifies them on the host: `spec.verify_on_host`)."""
        if spec is None:
            return token_ids
        if spec.uniform is None:   # every speculating row greedy: no distributions needed
            return token_ids if spec.verify_on_host else greedy_verify(token_ids, spec)
        output, _ = rejection_sample(token_ids, probs, spec)
        # Padding entries of row_index repeat a sequence's last row: give them that row's value, so
        # the scatter writes each row one value (a boolean mask would cost a host sync).
        positions = torch.arange(output.shape[1], device=output.device).unsqueeze(0)
        values = output.gather(1, torch.minimum(positions, spec.num_drafts.unsqueeze(1)))
        return token_ids.scatter(0, spec.row_index.flatten(), values.flatten())

    def _exponential_noise(self, probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Exp(1) noise per logit: one batched draw, then seeded rows redrawn from their own generator state."""
        noise = torch.empty_like(probs)
        if len(metadata.seeded_rows) < probs.shape[0]:
            noise.exponential_()
        if metadata.seeded_rows:
            generator = self._generators.get(probs.device)
            if generator is None:
                generator = self._generators[probs.device] = torch.Generator(device=probs.device)
            for row, seed in zip(metadata.seeded_rows, metadata.row_seeds):
                generator.manual_seed(seed)
                noise[row].exponential_(generator=generator)
        return noise


# ---- pure tensor functions (each may modify its `logits` argument in place and returns the result) ----------

def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen token's logprob and rank, followed by the `num_logprobs` most likely tokens.

    Returns ids and values of shape [S, 1 + num_logprobs] and ranks [S] (count of tokens at least as likely).
    """
    token_ids = token_ids.long().unsqueeze(-1)
    chosen = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= chosen).sum(dim=-1)
    if num_logprobs == 0:
        return token_ids, chosen, ranks
    top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return torch.cat([token_ids, top_ids], dim=-1), torch.cat([chosen, top_values], dim=-1), ranks


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of tokens whose bit is 0 to -inf (bitmask [S, ceil(V / 32)] int32, little-endian bits)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)[:, :logits.shape[-1]]
    return logits.masked_fill_(allowed == 0, -math.inf)


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    return logits.index_put_((rows, token_ids), values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: torch.Tensor, stop_token_ids: torch.Tensor) -> torch.Tensor:
    """Ban the stop tokens of rows that have not produced `min_tokens` yet."""
    # new_full fills on the device; torch.tensor(..., device=cuda) would be a blocking host copy.
    return logits.index_put_((rows, stop_token_ids), logits.new_full((), -math.inf))


def apply_penalties(logits: torch.Tensor, prompt_tokens: tuple[torch.Tensor, torch.Tensor],
                    output_tokens: tuple[torch.Tensor, torch.Tensor], presence_penalties: torch.Tensor,
                    frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor) -> torch.Tensor:
    """Repetition (over prompt + output; divides positive logits, multiplies the others), then frequency
    (times the count in the output) and presence (once per token in the output). Tokens come as
    (row index, token id) pairs."""
    counts = torch.zeros_like(logits).index_put_(output_tokens, logits.new_ones(()), accumulate=True)
    in_output = counts > 0
    seen = in_output.clone().index_put_(prompt_tokens, in_output.new_ones(()))
    penalty = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits -= frequency_penalties.unsqueeze(1) * counts
    logits -= presence_penalties.unsqueeze(1) * in_output
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits.div_(temperature.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, compared in log space (no softmax needed)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)  # log(0) = -inf: off
    return logits.masked_fill_(logits < threshold, -math.inf)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
                      max_k: int | None = None) -> torch.Tensor:
    """Per-row top-k (vocab_size = off; exactly k tokens kept) then top-p: keep the smallest set of most
    likely tokens whose mass reaches p (mass re-normalised after top-k), never less than the top token.

    `max_k`, the largest k known on the host, lets every row be cut to its `max_k` best candidates with
    one `topk` instead of a full sort of the vocabulary.
    """
    if k is None and p is None:
        return logits
    vocab_size = logits.shape[-1]
    if k is not None and max_k is not None and max_k < vocab_size:
        candidates, candidate_ids = logits.topk(max_k, dim=-1)  # sorted, most likely first
        logits = torch.full_like(logits, -math.inf)
    else:
        candidates, candidate_ids = logits.sort(dim=-1, descending=True)
    if k is not None:
        positions = torch.arange(candidates.shape[-1], device=logits.device)
        candidates.masked_fill_(positions >= k.unsqueeze(1), -math.inf)
    if p is not None:
        probs = candidates.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        threshold = torch.where(p < 1.0, p - _TOP_P_SLACK, math.inf).unsqueeze(1)
        drop = mass_before >= threshold
        drop[:, 0] = False
        candidates.masked_fill_(drop, -math.inf)
    return logits.scatter_(-1, candidate_ids, candidates)


def apply_top_k_top_p_min_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
                            min_p: torch.Tensor | None, max_k: int | None = None) -> torch.Tensor:
    """All truncation filters, vLLM's order: min-p first, then top-k and top-p (at most one sort)."""
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    return apply_top_k_top_p(logits, k, p, max_k)


def random_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i."""
    # Exp(1) draws can round to 0; clamping keeps 0/0 = NaN away from masked tokens.
    return probs.div_(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


# ---- seeds and rows --------------------------------------------------------------------------------------

def _row_seed(seed: int, sample_index: int, position: int) -> int:
    """A 63-bit generator seed mixing a request's seed, sample index and position (splitmix64 finaliser),
    so nearby triples do not give correlated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _flat_tokens(token_lists: list[list[int]], row_ids: list[int], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors for all tokens of the lists; numpy converts the ids at C speed."""
    lengths = [len(t) for t in token_lists]
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists] or [np.empty(0, np.int64)])
    token_ids = _to_device(torch.from_numpy(flat), device)
    rows = torch.repeat_interleave(_to_device(torch.tensor(row_ids, dtype=torch.int64), device),
                                   _to_device(torch.tensor(lengths, dtype=torch.int64), device),
                                   output_size=len(flat))  # the size given: no host sync
    return rows, token_ids


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # From pageable memory: CUDA stages the bytes and returns without waiting for the stream. Pinning
    # each small per-step tensor first cost up to 20 ms of host time per new size.
    return tensor.to(device, non_blocking=True)
