"""Draft-model proposer: a small model proposes k tokens per speculating sequence, on the device,
inside the runner's step (before the target's verification pass).

Two kinds of draft:
  * `draft_layers = N`: the target's first N layers, its final norm and LM head (LayerSkip-style
    self-speculation). Those layers' KV for a token is the same in draft and target, so the draft
    writes into the target's own cache: no extra memory, nothing to catch up.
  * a separate model (folder, GGUF, dummy config) with the same vocabulary: it has its own KV tensors
    indexed by the same block ids, so the block manager's one block table serves both (ARCHITECTURE.md).
    It runs over every token the target computes, so its cache never falls behind.

Step 0 runs the draft over the step's whole flat batch (draft positions hold placeholders; causal
attention keeps them from affecting the positions that matter) and samples d_1 at each speculating
sequence's last known token. Steps 1..k-1 feed d_j back as a one-token-per-sequence batch. A separate
draft also runs d_k, so its cache holds every draft that may be accepted.

Sampling follows the request's temperature / top-k / top-p / min-p (penalties and bias are left out:
any draft distribution q keeps verification exact, and q is returned for it).
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from minivllm.attention.metadata import AttentionMetadata, set_forward_context
from minivllm.layers.sampler import (SamplingMetadata, apply_temperature, apply_top_k_top_p_min_p, greedy_argmax,
                                     random_sample)
from minivllm.spec_decode.seeding import exponential_noise


class EarlyExitModel(nn.Module):
    """The target's first `num_layers` layers, then its final norm and LM head."""

    def __init__(self, target: nn.Module, num_layers: int) -> None:
        super().__init__()
        inner = getattr(target, "model", None)
        if inner is None or "num_layers" not in inspect.signature(inner.forward).parameters:
            raise ValueError(f"draft_layers needs a model that can exit early (the Llama family); "
                             f"{type(target).__name__} cannot")
        total = len(inner.layers)
        if not 1 <= num_layers < total:
            raise ValueError(f"draft_layers must be in [1, {total - 1}] for a target of {total} layers, got {num_layers}")
        self.target, self.num_layers = target, num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.target.model(input_ids, positions, num_layers=self.num_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden_states)


class DraftModelProposer:
    proposes_on_device = True

    def __init__(self, model: nn.Module, shares_target_kv: bool) -> None:
        self.model = model
        self.shares_target_kv = shares_target_kv

    @torch.inference_mode()
    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """A step without drafts: a separate draft still computes its KV for the step's tokens."""
        if not self.shares_target_kv:
            with set_forward_context(metadata):
                self.model(input_ids, positions)

    @torch.inference_mode()
    def propose(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                spec, rows_per_step: list[SamplingMetadata], last_hidden_index: torch.Tensor,
                last_positions_cpu: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fill the drafts into `input_ids` (in place) and return (draft ids [N, K], q [N, K, V] or None).

        `spec` is the step's SpecLayout; `rows_per_step[j]` the sampling metadata of position j of every
        speculating sequence; `last_hidden_index` [N] the flat row of each one's last known token.
        """
        num_seqs, k = spec.draft_token_ids.shape
        with set_forward_context(metadata):
            hidden = self.model(input_ids, positions)
        logits = self.model.compute_logits(hidden[last_hidden_index])
        block_tables = metadata.block_tables[torch.as_tensor(spec.seq_index, device=input_ids.device)]
        draft_ids, draft_probs = [], []
        num_steps = k + (0 if self.shares_target_kv else 1)
        for j in range(num_steps):
            if j < k:
                ids, probs = sample_draft(logits, rows_per_step[j])
                draft_ids.append(ids)
                draft_probs.append(probs)
            if j == num_steps - 1:
                break
            # Feed d_{j+1} at position last + j + 1; rows whose drafts ended write nothing.
            rows = spec.draft_positions[:, j]
            valid = j < spec.num_drafts_d
            step_metadata = AttentionMetadata(
                slot_mapping=torch.where(valid, metadata.slot_mapping[rows], -1),
                query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=input_ids.device),
                seq_lens=(positions[rows] + 1).to(torch.int32),
                block_tables=block_tables,
                max_query_len=1,
                max_seq_len=max(last_positions_cpu) + j + 2,
                query_start_loc_cpu=list(range(num_seqs + 1)),
                seq_lens_cpu=[min(p + j + 2, p + 1 + d) for p, d in zip(last_positions_cpu, spec.num_drafts.tolist())])
            with set_forward_context(step_metadata):
                hidden = self.model(draft_ids[j], positions[rows])
            logits = self.model.compute_logits(hidden)
        ids = torch.stack(draft_ids, dim=1)
        # Padding entries of draft_positions repeat a sequence's last draft row: give them its value.
        last = torch.minimum(torch.arange(k, device=ids.device).unsqueeze(0), spec.num_drafts_d.unsqueeze(1) - 1)
        input_ids[spec.draft_positions.flatten()] = ids.gather(1, last).flatten()
        probs = None if any(p is None for p in draft_probs) else torch.stack(draft_probs, dim=1)
        return ids, probs


def sample_draft(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens for one position of each sequence: argmax on greedy rows, else a draw from q
    (temperature, min-p, top-k, top-p). Returns (ids [N], q [N, V] or None when every row is greedy)."""
    greedy = greedy_argmax(logits)
    if metadata.all_greedy:
        return greedy, None
    logits = apply_temperature(logits.float(), metadata.temperature)
    logits = apply_top_k_top_p_min_p(logits, metadata.top_k, metadata.top_p, metadata.min_p, max_k=metadata.max_top_k)
    probs = logits.softmax(dim=-1)
    noise = exponential_noise(probs.shape, probs.device, metadata.seeded_rows, metadata.row_seeds, salt=1)
    ids = random_sample(probs.clone(), noise)
    if metadata.greedy_mask is not None:
        ids = torch.where(metadata.greedy_mask, greedy, ids)
    return ids, probs
