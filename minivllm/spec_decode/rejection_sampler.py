"""Verification of draft tokens: exact rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

Pure tensor functions; the sampler calls them after it has drawn one token per verified position
from the target distribution p (the processed distribution: bias, penalties, temperature, top-k/p,
min-p applied). For a sequence with drafts d_1..d_k proposed from distributions q_1..q_k:

  * random rows accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), in order, until the first
    rejection at j = r; position r then takes a token from norm(max(0, p_r - q_r)). When all k are
    accepted, position k takes the token already drawn from p_k (the bonus token). The output is then
    distributed exactly as k + 1 tokens drawn from the target one by one.
  * greedy rows accept while the draft equals the target's argmax, then take the argmax.

A proposer without a distribution (n-gram) proposes deterministically: q is one-hot on the draft,
so acceptance is p(d) and the residual is p with d removed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.kernels.greedy_verify import greedy_verify_reference, greedy_verify_triton


@dataclass
class SpecDecodeMetadata:
    """The verified positions of a step, `N` speculating sequences with up to `K` drafts each.

    `row_index[n, j]` is the sampling row of sequence n's position j (j = 0..num_drafts[n]; later
    entries repeat the last row and are ignored)."""
    row_index: torch.Tensor               # [N, K + 1] int64
    num_drafts: torch.Tensor              # [N] int64
    draft_token_ids: torch.Tensor         # [N, K] int64 (entries past num_drafts arbitrary)
    draft_probs: torch.Tensor | None      # [N, K, V] fp32, None when drafts are deterministic
    is_greedy: torch.Tensor | None        # [N] bool (None: every speculating sequence is greedy)
    uniform: torch.Tensor | None          # [N, K] U(0, 1) for the acceptance tests (None: all greedy)
    residual_noise: torch.Tensor | None   # [N, V] Exp(1) for drawing from the residual (None: all greedy)
    # Every speculating row greedy and the drafts known on the host: the sampler leaves the argmaxes as
    # they are and the runner verifies them once read back (`greedy_verify_host`), a launch fewer a step.
    verify_on_host: bool = False

    @property
    def max_num_drafts(self) -> int:
        return self.draft_token_ids.shape[1]


def accept_mask(target_probs_of_drafts: torch.Tensor, draft_probs_of_drafts: torch.Tensor | None,
                uniform: torch.Tensor) -> torch.Tensor:
    """Random rows: accept draft j when u_j < p_j(d_j) / q_j(d_j), written without the division."""
    q = 1.0 if draft_probs_of_drafts is None else draft_probs_of_drafts
    return uniform * q < target_probs_of_drafts


def greedy_verify(sampled: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
    """Every speculating row greedy: `sampled` [S] holds the argmax of every row (and is consumed).
    Returns [S] with the rows past each sequence's first mismatch set to -1 (what `Sampler._verify` makes
    of `rejection_sample`'s output): one kernel launch on CUDA, about ten tensor ops elsewhere."""
    verify = greedy_verify_triton if sampled.is_cuda else greedy_verify_reference
    return verify(sampled, spec.row_index, spec.num_drafts, spec.draft_token_ids)


def greedy_verify_host(token_ids: list[int], row_index: np.ndarray, num_drafts: np.ndarray,
                       draft_token_ids: np.ndarray) -> None:
    """`greedy_verify` on the host, in place on a step's read-back argmaxes (shapes as in
    SpecDecodeMetadata). At batch 1 a kernel launch costs the host more than this loop over k + 1 ids,
    and the result is needed on the host only: a step chained behind the verification reads the last row,
    which matters only when every draft was accepted (else that step is discarded)."""
    for rows, n, drafts in zip(row_index.tolist(), num_drafts.tolist(), draft_token_ids.tolist()):
        for j in range(n):
            if token_ids[rows[j]] != drafts[j]:
                for row in rows[j + 1:n + 1]:
                    token_ids[row] = -1
                break


def rejection_sample(sampled: torch.Tensor, probs: torch.Tensor | None, spec: SpecDecodeMetadata
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampled` [S]: the token drawn from the target at every row (argmax on greedy rows); `probs`
    [S, V] the target distributions (None when every speculating row is greedy).

    Returns `output` [N, K + 1] (the accepted drafts, then the corrected or bonus token, then -1) and
    `num_accepted` [N] (accepted drafts; the sequence gains num_accepted + 1 tokens).
    """
    num_seqs, k = spec.draft_token_ids.shape
    drafts = spec.draft_token_ids
    positions = torch.arange(k, device=sampled.device)
    valid = positions < spec.num_drafts.unsqueeze(1)
    target = sampled[spec.row_index]                                    # [N, K + 1]
    accepted = drafts == target[:, :k]
    if spec.uniform is None:
        probs = None   # every speculating row is greedy
    if probs is not None:
        draft_rows = spec.row_index[:, :k]
        safe_drafts = drafts.clamp_min(0)
        p_of_drafts = probs[draft_rows].gather(-1, safe_drafts.unsqueeze(-1)).squeeze(-1)   # [N, K]
        q_of_drafts = None if spec.draft_probs is None else \
            spec.draft_probs.gather(-1, safe_drafts.unsqueeze(-1)).squeeze(-1)
        random_accepted = accept_mask(p_of_drafts, q_of_drafts, spec.uniform)
        accepted = torch.where(spec.is_greedy.unsqueeze(1), accepted, random_accepted)
    accepted &= valid
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)               # leading run of acceptances
    first_rejected = num_accepted.unsqueeze(1)

    # The token at position num_accepted: the target's own draw (greedy, or the bonus after all drafts
    # were accepted), or a draw from the residual after a rejection on a random row.
    final = target.gather(1, first_rejected).squeeze(1)
    if probs is not None:
        rejected = ~spec.is_greedy & (num_accepted < spec.num_drafts)
        row = spec.row_index.gather(1, first_rejected).squeeze(1)
        p = probs[row]                                                        # [N, V]
        rejected_draft = drafts.gather(1, first_rejected.clamp_max(k - 1)).squeeze(1).clamp_min(0)
        if spec.draft_probs is None:
            residual = p.scatter(1, rejected_draft.unsqueeze(1), 0.0)
        else:
            q = spec.draft_probs.gather(1, first_rejected.clamp_max(k - 1).unsqueeze(-1).expand(-1, -1, p.shape[1]))
            residual = (p - q.squeeze(1)).clamp_min_(0.0)
        # Rounding can leave no mass (p == q); the target itself is then the right distribution.
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
        resampled = (residual / spec.residual_noise.clamp_min(torch.finfo(p.dtype).tiny)).argmax(dim=1)
        final = torch.where(rejected, resampled, final)

    output = torch.where(positions.unsqueeze(0) < first_rejected, drafts, -1)
    output = torch.cat([output, torch.full_like(output[:, :1], -1)], dim=1)
    output.scatter_(1, first_rejected, final.unsqueeze(1))
    return output, num_accepted
