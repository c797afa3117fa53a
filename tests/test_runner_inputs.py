"""The runner's host-side plumbing: staging buffers and the CUDA graph size ladders (no GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.worker.cuda_graph import SPEC_DECODE_ROWS, capture_sizes, max_decode_rows, mixed_capture_sizes
from minivllm.worker.inputs import StagingBuffer


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
