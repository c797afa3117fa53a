"""The runner's host-side plumbing: staging buffers, the CUDA graph size ladders and a verify step's staging into
a decode graph (no GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.core.interfaces import SchedulerOutput
from minivllm.core.sequence import Sequence, SequenceGroup
from minivllm.sampling_params import SamplingParams
from minivllm.worker.cuda_graph import (SPEC_DECODE_ROWS, CUDAGraphRunner, GraphInputs, capture_sizes,
                                        max_decode_rows, mixed_capture_sizes)
from minivllm.worker.inputs import PreviousSamples, StagingBuffer, prepare_inputs, prepare_sampling


def test_staging_buffer_returns_every_array_on_a_16_byte_boundary():
    """Both dtypes in one transfer (one copy a step): values, dtypes and shapes kept, each array aligned."""
    rng = np.random.default_rng(0)
    buffer = StagingBuffer(torch.device("cpu"))
    for sizes in ([157, 157, 3], [1, 2, 3, 5], [0, 7, 0, 9], [64]):
        groups = []
        for dtype, shift in ((torch.int64, 0), (torch.int32, 1)):
            arrays = [rng.integers(-5, 1000, size=n + shift) for n in sizes]
            arrays.append(rng.integers(0, 9, size=(3, 5 + shift)))  # a 2-D array keeps its shape
            groups.append((dtype, arrays))
        out = buffer.transfer(groups)
        assert len(out) == len(groups)
        for (dtype, arrays), tensors in zip(groups, out):
            assert len(tensors) == len(arrays)
            for array, tensor in zip(arrays, tensors):
                assert tensor.dtype == dtype and tuple(tensor.shape) == array.shape
                assert tensor.data_ptr() % 16 == 0, "an unaligned array recompiles Triton kernels mid-run"
                assert tensor.tolist() == array.tolist()


def test_graph_size_ladders_cover_every_step_size():
    sizes = capture_sizes(100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 100 and sizes == sorted(set(sizes))
    mixed = mixed_capture_sizes(4096)
    assert mixed[0] == 64 and mixed[-1] == 4096 and mixed == sorted(set(mixed))
    for n in range(1, 4097):   # every token count has a bucket: under 64 padding rows up to 2,048, 256 above
        padded = next(s for s in mixed if s >= n)
        assert padded - n < 64 if n <= 2048 else padded - n < 256
    assert mixed_capture_sizes(40) == [40] and mixed_capture_sizes(0) == []


def test_decode_graphs_take_verify_steps_of_every_sequence_up_to_the_cap():
    """A verify step of each sequence with k drafts is max_num_seqs * (1 + k) rows: a decode graph holds it up to
    SPEC_DECODE_ROWS rows; without speculation, or past the cap, the graphs end at max_num_seqs."""
    assert max_decode_rows(1, 15) == 16 and max_decode_rows(8, 5) == 48 and max_decode_rows(32, 0) == 32
    assert max_decode_rows(32, 5) == SPEC_DECODE_ROWS and max_decode_rows(256, 5) == 256
    assert capture_sizes(max_decode_rows(1, 5))[-1] == 6 and capture_sizes(max_decode_rows(1, 15)) == [1, 2, 4, 8, 16]


class _HostEvent:
    def synchronize(self) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


class _HostGraphs(CUDAGraphRunner):
    """The graph runner's staging (`decode_size`, `stage_decode`, `row_views`) over its input buffers laid out on the
    CPU; no graphs."""

    def __init__(self, max_batch: int, max_blocks: int) -> None:
        self.sizes, self.max_seqs, self.max_batch = capture_sizes(max_batch), max_batch, max_batch
        self._lay_out_decode_inputs(max_blocks, torch.device("cpu"))
        self._mirror_copied, self._row_views = _HostEvent(), {}
        self.decode_query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32)


def test_decode_inputs_copy_through_the_staged_rows_only():
    """`copy_rows(r)` moves every per-row buffer and the first r block-table rows from the mirror, and nothing after
    them: a decode step's copy ends with its own rows' block tables."""
    inputs = GraphInputs(8, 8, 3, torch.device("cpu"), mirror=True)
    host = inputs.host
    host["input_ids"][:] = np.arange(8)
    host["positions"][:] = np.arange(8) + 10
    host["slot_mapping"][:] = np.arange(8) + 20
    host["seq_lens"][:] = np.arange(8) + 30
    host["block_tables"][:] = np.arange(24).reshape(8, 3)
    inputs.copy_rows(2)
    assert inputs.input_ids.tolist() == list(range(8)) and inputs.positions.tolist() == list(range(10, 18))
    assert inputs.slot_mapping.tolist() == list(range(20, 28)) and inputs.seq_lens.tolist() == list(range(30, 38))
    assert inputs.block_tables[:2].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert inputs.block_tables[2:].abs().sum() == 0


def _sequence(token_ids: list[int], block_table: list[int], num_computed: int) -> Sequence:
    seq = SequenceGroup("r", None, token_ids, SamplingParams(max_tokens=64)).seqs[0]
    seq.block_table, seq.num_computed_tokens = block_table, num_computed
    return seq


@pytest.mark.parametrize("sequence_tensors", [True, False])
def test_verify_step_staged_into_a_decode_graph_one_row_per_token(sequence_tensors):
    """A verify step of two sequences (3 and 2 drafts) lands in the 8-row decode graph's buffers one row per token:
    its token, position, slot, context length (position + 1) and its sequence's block-table row; padding rows write
    no KV. The per-sequence metadata is the same whether it goes to the device or stays on the host, and staying
    on the host makes no staging copy."""
    block_size = 4
    a = _sequence(list(range(100, 110)), [7, 3, 9, 1], 10)   # 10 tokens known, 3 drafts: rows at positions 9..12
    b = _sequence(list(range(200, 205)), [5, 2], 5)       # 5 tokens known, 2 drafts: rows at positions 4..6
    out = SchedulerOutput(seqs=[a, b], num_computed_tokens=[9, 4], num_scheduled_tokens=[4, 3], num_samples=[1, 1],
                          spec_token_ids=[[11, 12, 13], [21, 22]])
    graphs, stager = _HostGraphs(8, 4), StagingBuffer(torch.device("cpu"))
    transfers = []
    transfer = stager.transfer
    stager.transfer = lambda groups, stream=None: transfers.append(groups) or transfer(groups, stream)
    inputs = prepare_inputs(out, block_size, stager, graph=graphs, sequence_tensors=sequence_tensors)
    assert inputs.staged == (graphs, 8)
    positions = [9, 10, 11, 12, 4, 5, 6]
    tables = [[7, 3, 9, 1]] * 4 + [[5, 2]] * 3
    slots = [table[p // block_size] * block_size + p % block_size for p, table in zip(positions, tables)]
    assert graphs.input_ids[:7].tolist() == [109, 11, 12, 13, 204, 21, 22]
    assert graphs.positions[:7].tolist() == positions and inputs.positions.tolist() == positions
    assert graphs.slot_mapping.tolist() == slots + [-1]
    assert graphs.seq_lens[:7].tolist() == [p + 1 for p in positions] and graphs.seq_lens[7] == 0
    assert [row[:len(table)] for row, table in zip(graphs.block_tables[:7].tolist(), tables)] == tables
    meta = inputs.metadata
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu == [0, 4, 7]
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [13, 7] and meta.num_seqs == 2
    assert meta.block_tables.tolist() == [[7, 3, 9, 1], [5, 2, 0, 0]]
    assert (meta.max_query_len, meta.min_query_len, meta.max_seq_len) == (4, 3, 13)
    assert len(transfers) == sequence_tensors   # the host-only metadata made no staging copy


def test_batch_1_steps_staged_into_a_decode_graph():
    """One sequence (the path a batch-1 step takes): a verify step of 3 drafts lands one row per token like the general
    path's rows, and a plain step whose newest token is still being sampled takes it from the step in flight (its row
    in that step's sampled ids) into its input."""
    block_size = 4
    seq = _sequence(list(range(100, 110)), [7, 3, 9, 1], 9)
    graphs, stager = _HostGraphs(8, 4), StagingBuffer(torch.device("cpu"))
    verify = SchedulerOutput(seqs=[seq], num_computed_tokens=[9], num_scheduled_tokens=[4], num_samples=[1],
                             spec_token_ids=[[11, 12, 13]])
    inputs = prepare_inputs(verify, block_size, stager, graph=graphs, sequence_tensors=False)
    positions = [9, 10, 11, 12]
    slots = [[7, 3, 9, 1][p // block_size] * block_size + p % block_size for p in positions]
    assert inputs.staged == (graphs, 4)
    assert graphs.input_ids[:4].tolist() == [109, 11, 12, 13] and inputs.input_ids.tolist() == [109, 11, 12, 13]
    assert graphs.positions[:4].tolist() == positions and graphs.slot_mapping[:4].tolist() == slots
    assert graphs.seq_lens[:4].tolist() == [p + 1 for p in positions]
    assert graphs.block_tables[:4].tolist() == [[7, 3, 9, 1]] * 4
    meta = inputs.metadata
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu == [0, 4]
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [13] and meta.num_seqs == 1
    assert (meta.max_query_len, meta.min_query_len, meta.max_seq_len) == (4, 4, 13)
    assert meta.block_tables.tolist() == [[7, 3, 9, 1]]

    seq.num_computed_tokens = 10   # token 10 is in flight: row 2 of the step before's sampled ids
    previous = PreviousSamples(torch.tensor([5, 6, 777]), {seq.seq_id: 2})
    plain = SchedulerOutput(seqs=[seq], num_computed_tokens=[10], num_scheduled_tokens=[1], num_samples=[1])
    inputs = prepare_inputs(plain, block_size, stager, previous, graph=graphs, sequence_tensors=False)
    assert inputs.staged == (graphs, 1) and inputs.input_ids.tolist() == [777]
    assert graphs.positions[:1].tolist() == [10] and graphs.slot_mapping[:1].tolist() == [9 * 4 + 2]
    assert graphs.seq_lens[:1].tolist() == [11]
    meta = inputs.metadata
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [11] and meta.query_start_loc.tolist() == [0, 1]
    assert meta.block_tables.tolist() == [[7, 3, 9, 1]] and meta.max_seq_len == 11


def test_a_decode_step_samples_every_row_without_staging_its_indices():
    """Sampling's rows: a plain decode step of two sequences samples rows 0 and 1 and stages nothing for them; a
    step with a prompt chunk samples each sequence's last row, staged; a verify step stages its drafts' layout."""
    a = _sequence(list(range(100, 110)), [7, 3, 9, 1], 9)
    b = _sequence(list(range(200, 205)), [5, 2], 4)
    steps = {"decode": (SchedulerOutput(seqs=[a, b], num_computed_tokens=[9, 4], num_scheduled_tokens=[1, 1],
                                        num_samples=[1, 1]), [0, 1], 0),
             "chunk": (SchedulerOutput(seqs=[a, b], num_computed_tokens=[6, 4], num_scheduled_tokens=[4, 1],
                                       num_samples=[1, 1]), [3, 4], 1),
             "verify": (SchedulerOutput(seqs=[a, b], num_computed_tokens=[9, 4], num_scheduled_tokens=[3, 1],
                                        num_samples=[1, 1], spec_token_ids=[[11, 12], []]), [0, 1, 2, 3], 1)}
    for name, (out, rows, copies) in steps.items():
        stager = StagingBuffer(torch.device("cpu"))
        inputs = prepare_inputs(out, 4, stager)
        transfers = []
        transfer = stager.transfer
        stager.transfer = lambda groups, stream=None: transfers.append(groups) or transfer(groups, stream)
        prepare_sampling(inputs, out, stager)
        assert inputs.logits_indices.tolist() == rows and inputs.logits_indices.dtype == torch.int64, name
        assert len(transfers) == copies, name
        assert inputs.samples_every_row == (rows == list(range(sum(out.num_scheduled_tokens)))), name
