"""The chunked argmax kernel (greedy sampling) against torch.argmax: ties across and within chunks,
-inf rows, NaN, a row length that is no multiple of the chunk. Interpreted on CPU, compiled on CUDA."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from minivllm.kernels.argmax import CHUNK, argmax_rows, argmax_rows_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("rows,vocab,dtype", [(1, 3 * CHUNK + 17, torch.bfloat16), (3, CHUNK + 1, torch.float32),
                                              (2, 5, torch.float16)])
def test_random_rows_match_torch(rows, vocab, dtype):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEVICE)
    assert torch.equal(argmax_rows_triton(x), x.argmax(dim=-1))


def test_ties_go_to_the_lowest_index():
    x = torch.full((4, 2 * CHUNK + 5), float("-inf"))
    x[1, [7, CHUNK + 3, 2 * CHUNK + 1]] = 1.0          # across chunks
    x[2, [CHUNK + 9, CHUNK + 10]] = 2.0                  # within one chunk, not the first
    x[3, :] = 0.5                                       # every entry equal
    x = x.to(DEVICE)
    assert argmax_rows_triton(x).tolist() == [0, 7, CHUNK + 9, 0] == x.argmax(dim=-1).tolist()


def test_nan_wins_and_strided_rows():
    base = torch.randn(3, 2 * CHUNK + 64)
    base[1, CHUNK + 2] = float("nan")
    x = base[:, 32:-32].to(DEVICE)   # rows with a stride longer than their length
    assert argmax_rows_triton(x).tolist()[1] == CHUNK + 2 - 32
    assert torch.equal(argmax_rows_triton(x), x.argmax(dim=-1))


def test_dispatch_keeps_torch_for_short_rows_and_off_cuda():
    x = torch.randn(2, 100, device=DEVICE)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_gpu_vocab_sized_rows(rows):
    x = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
