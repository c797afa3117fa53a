"""Build the tensors that verification needs for one step (see rejection_sampler.py)."""
from __future__ import annotations

import torch

from minivllm.layers.sampler import SamplingRow, _row_seed
from minivllm.spec_decode.rejection_sampler import SpecDecodeMetadata
from minivllm.spec_decode.seeding import exponential_noise, uniform


def build_spec_metadata(layout, rows: list[SamplingRow], draft_token_ids: torch.Tensor | None,
                        draft_probs: torch.Tensor | None, vocab_size: int, device: torch.device) -> SpecDecodeMetadata:
    """`layout` is the step's SpecLayout; `draft_token_ids` the device proposer's drafts (None: the
    drafts are the layout's own, proposed on the host)."""
    first_rows = [rows[r] for r in layout.row_index_cpu[:, 0].tolist()]
    num_seqs, k = layout.draft_token_ids.shape
    seeded, seeds = [], []
    for n, row in enumerate(first_rows):
        if row.params.seed is not None and not row.params.greedy:
            seeded.append(n)
            seeds.append(_row_seed(row.params.seed, row.sample_index, row.num_output_tokens))
    greedy = [row.params.greedy for row in first_rows]
    all_greedy = all(greedy)
    return SpecDecodeMetadata(
        row_index=layout.row_index,
        num_drafts=layout.num_drafts_d,
        draft_token_ids=layout.draft_token_ids_d if draft_token_ids is None else draft_token_ids,
        draft_probs=draft_probs,
        is_greedy=None if all_greedy else torch.tensor(greedy).to(device, non_blocking=True),
        # Random numbers only for random rows (greedy verification compares argmaxes).
        uniform=None if all_greedy else uniform((num_seqs, k), device, seeded, seeds, salt=2),
        residual_noise=None if all_greedy else exponential_noise((num_seqs, vocab_size), device, seeded, seeds,
                                                                  salt=3),
        verify_on_host=layout.verified_on_host and draft_token_ids is None,
    )
