"""Flatten one SchedulerOutput into the model's input tensors and attention metadata.

Vectorised with numpy over tokens; the only Python loop is over scheduled sequences. Host arrays are
copied to the device in one pinned, non-blocking transfer each.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.core.interfaces import SchedulerOutput
from minivllm.layers.sampler import SamplingRow


@dataclass
class ModelInputs:
    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows of the hidden states to sample from (repeated for forks)
    sampling_rows: list[SamplingRow]
    # Host copies, used to fill CUDA-graph buffers without a device round trip.
    seq_lens_np: np.ndarray
    block_tables_np: np.ndarray
    slot_mapping_np: np.ndarray


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def prepare_inputs(scheduler_output: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    seqs = scheduler_output.seqs
    num_scheduled = np.asarray(scheduler_output.num_scheduled_tokens, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    seq_lens = starts + num_scheduled
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    token_ids: list[int] = []
    for seq, start, n in zip(seqs, starts.tolist(), num_scheduled.tolist()):
        token_ids.extend(seq.token_ids[start:start + n])

    max_blocks = max(len(s.block_table) for s in seqs)
    block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for i, seq in enumerate(seqs):
        block_tables[i, :len(seq.block_table)] = seq.block_table

    # Per-token sequence index and position, without a Python loop over tokens.
    seq_index = np.repeat(np.arange(len(seqs)), num_scheduled)
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - starts, num_scheduled)
    slot_mapping = (block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)

    logits_indices: list[int] = []
    rows: list[SamplingRow] = []
    for i, (seq, num_samples) in enumerate(zip(seqs, scheduler_output.num_samples)):
        for k in range(num_samples):
            logits_indices.append(int(query_start_loc[i + 1]) - 1)
            # A forking sequence samples for its future siblings too: sample k becomes sibling k.
            rows.append(SamplingRow(seq.sampling_params, seq.prompt_token_ids, seq.output_token_ids,
                                    sample_index=seq.index + k))

    metadata = AttentionMetadata(
        slot_mapping=_to_device(slot_mapping, device),
        query_start_loc=_to_device(query_start_loc.astype(np.int32), device),
        seq_lens=_to_device(seq_lens.astype(np.int32), device),
        block_tables=_to_device(block_tables, device),
        max_query_len=int(num_scheduled.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return ModelInputs(
        input_ids=_to_device(np.asarray(token_ids, dtype=np.int64), device),
        positions=_to_device(positions, device),
        metadata=metadata,
        logits_indices=_to_device(np.asarray(logits_indices, dtype=np.int64), device),
        sampling_rows=rows,
        seq_lens_np=seq_lens.astype(np.int32),
        block_tables_np=block_tables,
        slot_mapping_np=slot_mapping,
    )
