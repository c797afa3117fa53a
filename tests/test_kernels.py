"""Triton kernels against their plain-PyTorch references.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before Triton is
imported), on tiny shapes. Triton is a hard requirement: if it is missing this module fails to
import, which fails the run. The `gpu` tests use realistic shapes and run only where CUDA exists.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton  # noqa: E402,F401  (a missing Triton must fail here, not skip)

from minivllm.attention.metadata import AttentionMetadata  # noqa: E402
from minivllm.attention.torch_backend import (  # noqa: E402
    TorchAttentionBackend, paged_attention_reference, write_kv_reference)
from minivllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from minivllm.kernels import (  # noqa: E402
    choose_decode_splits, fused_add_rms_norm, fused_add_rms_norm_reference,
    paged_decode_attention, paged_prefill_attention, rms_norm, rms_norm_reference, silu_and_mul,
    silu_and_mul_reference, write_kv)
from minivllm.kernels.prefill_attention import PrefillConfig, _tile_config  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def assert_rounds_like_reference(actual, expected, dtype):
    """16-bit results must round exactly where the reference rounds: a fused op that skips an
    intermediate rounding differs in a large share of elements, while exp/rsqrt implementations
    differ by an ulp only rarely. (The interpreter truncates fp32 -> bf16, so bf16 is checked only
    on a GPU.)"""
    if dtype == torch.float16 or (dtype == torch.bfloat16 and DEVICE.type == "cuda"):
        assert (actual != expected).float().mean().item() < 0.01


def make_batch(seq_lens, query_lens, num_kv_heads, group, head_dim, dtype, block_size=16,
               num_padding_rows=0, seed=0):
    """Random caches, shuffled block tables and this step's q/k/v for sequences whose last
    `query_lens[i]` of `seq_lens[i]` tokens are being computed now (the rest is cached prefix).
    Unused block-table entries hold an out-of-range id, so touching one would fault."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    blocks_per_seq = [triton.cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    permutation = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(max(blocks_per_seq), 1) + 1
    block_tables = torch.full((len(seq_lens), width), 1 << 30, dtype=torch.int32)
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = torch.tensor(permutation[:count], dtype=torch.int32)
        permutation = permutation[count:]
    slots, query_start_loc = [], [0]
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        for position in range(seq_len - query_len, seq_len):
            # A negative position is a padding decode row over an empty context: never written.
            slots.append(-1 if position < 0 else
                         int(block_tables[i, position // block_size]) * block_size + position % block_size)
        query_start_loc.append(query_start_loc[-1] + query_len)
    slots += [-1] * num_padding_rows
    num_tokens = len(slots)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=list(seq_lens))
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    query = randn(num_tokens, num_kv_heads * group, head_dim)
    key = randn(num_tokens, num_kv_heads, head_dim)
    value = randn(num_tokens, num_kv_heads, head_dim)
    return query, key, value, k_cache, v_cache, metadata


def run_both(backend, query, key, value, k_cache, v_cache, metadata, scale):
    """Write and attend with `backend` and with the reference, each on its own copy of the cache;
    returns (output, reference output) over the rows that belong to sequences."""
    reference_k, reference_v = k_cache.clone(), v_cache.clone()
    backend.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
    out = backend.attend(query, k_cache, v_cache, metadata, scale, key=key, value=value)
    reference = TorchAttentionBackend()
    reference.write_kv(key, value, reference_k, reference_v, metadata.slot_mapping)
    expected = reference.attend(query, reference_k, reference_v, metadata, scale)
    assert torch.equal(k_cache, reference_k) and torch.equal(v_cache, reference_v)
    rows = metadata.query_start_loc_cpu[-1]
    return out[:rows], expected[:rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_scatters_strided_rows_and_skips_padding(dtype):
    generator = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 3, 64   # 3 heads: not a power of two
    # key/value as strided views into one fused buffer, as a QKV projection produces them.
    fused = torch.randn(7, 2, num_kv_heads, head_dim, generator=generator).to(dtype).to(DEVICE)
    key, value = fused[:, 0], fused[:, 1]
    slot_mapping = torch.tensor([5, -1, 17, 95, 16, -1, 40], device=DEVICE)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slot_mapping)
    write_kv_reference(key, value, expected_k, expected_v, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 5   # exactly the five real rows


# (seq_lens, group, head_dim, dtype, partition_size): 16/32 force split-K, 4096 forces one partition,
# None lets the shapes decide (here: one partition, the context being short). Lengths are odd, cross
# blocks, and include 1 and an empty padding row (seq_len 0, slot -1), whose output must be zeros.
DECODE_CASES = [
    ([37, 1, 70, 0], 1, 64, torch.float32, 4096),
    ([37, 1, 70, 0], 4, 128, torch.bfloat16, 16),
    ([50, 33, 16], 8, 64, torch.float32, 32),
    ([90, 17], 4, 64, torch.float16, None),
]


@pytest.mark.parametrize("seq_lens,group,head_dim,dtype,partition_size", DECODE_CASES)
def test_decode_matches_reference(seq_lens, group, head_dim, dtype, partition_size):
    query, key, value, k_cache, v_cache, metadata = make_batch(
        seq_lens, [1] * len(seq_lens), 2, group, head_dim, dtype, seed=len(seq_lens) + group)
    backend = TritonAttentionBackend(decode_partition_size=partition_size)
    out, expected = run_both(backend, query, key, value, k_cache, v_cache, metadata, head_dim ** -0.5)
    assert_close(out, expected, dtype)


def test_decode_wide_key_tiles_where_few_splits_cut_small_heads():
    """Fewer than WIDE_TILE_SPLITS splits at head_dim <= 64 take 128-key tiles (a one-row step's many splits, larger
    heads and an unsplit step keep 64); the split kernel with them matches the reference on odd lengths."""
    from minivllm.kernels.decode_attention import split_key_tile
    assert split_key_tile(64, 64, 6) == 128 and split_key_tile(64, 32, 15) == 128
    assert split_key_tile(64, 64, 88) == 64 and split_key_tile(64, 128, 6) == 64 and split_key_tile(64, 64, None) == 64
    assert split_key_tile(32, 64, 6) == 32   # fp32's tile stays
    query, key, value, k_cache, v_cache, metadata = make_batch([300, 151, 0], [1, 1, 1], 2, 4, 64, torch.bfloat16,
                                                               seed=5)
    out, expected = run_both(TritonAttentionBackend(), query, key, value, k_cache, v_cache, metadata, 64 ** -0.5)
    assert_close(out, expected, torch.bfloat16)


def test_decode_split_and_unsplit_agree_and_zero_an_empty_context():
    query, key, value, k_cache, v_cache, metadata = make_batch([200, 0], [1, 1], 1, 4, 64,
                                                               torch.float32, seed=3)
    write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
    args = (query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, 0.125)
    split = paged_decode_attention(*args, partition_size=64)        # four partitions in use
    whole = paged_decode_attention(*args, partition_size=1 << 20)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(split[1], torch.zeros_like(split[1]))


def test_decode_split_choice_depends_on_occupancy_and_length():
    from minivllm.kernels.decode_attention import (LONG_PARTITION_SIZE, MIN_PARTITION_SIZE, sequence_partition_size,
                                                   shortest_partition)
    # Two programs per SM already: no split.
    assert choose_decode_splits(64, 8, 4096, 132) is None
    # A program per SM: halves of at least LONG_PARTITION_SIZE tokens, so no split where no context has two.
    assert choose_decode_splits(17, 8, 4096, 132) == 2
    assert choose_decode_splits(64, 4, 4096, 132) == 2
    assert choose_decode_splits(17, 8, LONG_PARTITION_SIZE, 132) is None
    assert choose_decode_splits(64, 4, 768, 132) is None
    assert shortest_partition(17, 8, 132) == LONG_PARTITION_SIZE and shortest_partition(16, 8, 132) == 64
    assert sequence_partition_size(600, 2, LONG_PARTITION_SIZE) == LONG_PARTITION_SIZE
    assert sequence_partition_size(4000, 2, LONG_PARTITION_SIZE) == 2048
    # Fewer programs than SMs: split to about two a SM.
    assert choose_decode_splits(16, 8, 4096, 132) == 3
    # One sequence: enough splits to give the SMs two programs each (fewer when the context is short).
    assert choose_decode_splits(1, 8, 32768, 132) == 33
    assert choose_decode_splits(1, 8, 768, 132) == 768 // MIN_PARTITION_SIZE
    assert choose_decode_splits(4, 8, 32768, 132) == 9
    # A context no longer than one partition stays whole.
    assert choose_decode_splits(1, 8, MIN_PARTITION_SIZE, 132) is None
    # Each sequence: the smallest power of two >= one tile that needs at most `splits` partitions.
    for seq_len in (1, 63, 64, 65, 600, 4000, 32768):
        partition = sequence_partition_size(seq_len, 33)
        assert partition & (partition - 1) == 0 and partition >= MIN_PARTITION_SIZE
        assert triton.cdiv(seq_len, partition) <= 33
        assert partition == MIN_PARTITION_SIZE or triton.cdiv(seq_len, partition // 2) > 33
    assert sequence_partition_size(600, 33) == 64 and sequence_partition_size(4000, 33) == 128


# max_context (blocks x 16) sets the split count, not these lengths. The interpreter counts 8 SMs: 4 sequences
# cut contexts from one key tile up, 8 give every SM a program and cut only contexts over LONG_PARTITION_SIZE.
@pytest.mark.parametrize("seq_lens, blocks_per_seq", [([5, 70, 300, 1], 32),
                                                      ([5, 700, 1500, 2100, 1, 1024, 1025, 64], 160)])
def test_decode_split_per_sequence_lengths(seq_lens, blocks_per_seq):
    """Per-sequence partitions (short and long contexts in one batch, a graph-sized block table) give
    the reference's output: the kernel's device-side rule and the reduction agree on the partitions, and a
    context in one partition is written by the partition kernel alone."""
    gen = torch.Generator().manual_seed(3)
    block_size, kv_heads, group, head_dim = 16, 1, 2, 32
    num_blocks = len(seq_lens) * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE)
    tables = torch.randperm(num_blocks, generator=gen).view(len(seq_lens), blocks_per_seq).to(torch.int32).to(DEVICE)
    query = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    whole = paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, partition_size=1 << 20)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    for i, n in enumerate(seq_lens):   # against plain softmax attention over the gathered context
        rows = (tables[i].long()[:, None] * block_size + torch.arange(block_size, device=DEVICE)).flatten()[:n]
        k = k_cache.flatten(0, 1)[rows, 0]
        v = v_cache.flatten(0, 1)[rows, 0]
        expected = torch.softmax(query[i] @ k.t() * head_dim ** -0.5, dim=-1) @ v
        torch.testing.assert_close(out[i], expected, rtol=1e-4, atol=1e-4)


# (seq_lens, query_lens, group, head_dim, dtype, block_m, block_n): plain prefill, chunked prefill
# and prefix hits (cached prefix + chunk), decode rows mixed with chunks; small tiles force several
# query tiles per sequence and both the unmasked and the causal key loops.
PREFILL_CASES = [
    ([23, 40], [23, 40], 1, 64, torch.float32, 16, 16),             # plain prefill
    ([61, 1 + 37, 5], [29, 1, 5], 4, 64, torch.float32, 32, 16),     # chunk after prefix, decode, prefill
    ([45, 70, 19], [1, 13, 1], 8, 128, torch.bfloat16, 16, 16),      # decodes around a prefix-hit chunk
    ([33, 100], [33, 21], 4, 128, torch.bfloat16, None, None),       # default tiles
    ([17, 50], [17, 9], 1, 128, torch.float16, 16, 32),
    ([95, 41, 130], [37, 41, 3], 4, 64, torch.float32, 32, 32),      # odd prefixes and chunk lengths
]


# How the chunk's own keys are read: through the pages, from this step's key/value tensors (the
# prefix still through the pages), or from those through tensor descriptors.
KEY_SOURCES = {"paged": None, "contiguous": None, "tma": PrefillConfig(16, 16, 4, 2, tma=True)}


@pytest.mark.parametrize("key_source", KEY_SOURCES)
@pytest.mark.parametrize("seq_lens,query_lens,group,head_dim,dtype,block_m,block_n", PREFILL_CASES)
def test_prefill_matches_reference(seq_lens, query_lens, group, head_dim, dtype, block_m, block_n,
                                   key_source):
    query, key, value, k_cache, v_cache, metadata = make_batch(
        seq_lens, query_lens, 2, group, head_dim, dtype, num_padding_rows=3, seed=sum(query_lens))
    scale = head_dim ** -0.5
    reference_k, reference_v = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
    write_kv_reference(key, value, reference_k, reference_v, metadata.slot_mapping)
    assert torch.equal(k_cache, reference_k)
    fresh = {} if key_source == "paged" else dict(key=key, value=value, config=KEY_SOURCES[key_source])
    out = paged_prefill_attention(query, k_cache, v_cache, metadata.query_start_loc,
                                  metadata.seq_lens, metadata.block_tables, scale,
                                  block_m=block_m, block_n=block_n, **fresh)
    expected = paged_attention_reference(query, reference_k, reference_v,
                                         metadata.query_start_loc_cpu, metadata.seq_lens_cpu,
                                         metadata.block_tables, scale)
    rows = metadata.query_start_loc_cpu[-1]
    assert_close(out[:rows], expected[:rows], dtype)


# The host-side table's shape classes (verification, short and long prompts) and each launch
# option, on (k + 1)-query verification rows after cached prefixes mixed with a prompt chunk.
@pytest.mark.parametrize("max_query_len,config", [
    (6, None), (40, None), (4096, None),
    (None, PrefillConfig(32, 16, 4, 2, trans_k=True, heavy_first=False)),
    (None, PrefillConfig(16, 32, 4, 2, trans_k=False, heavy_first=True)),
    (None, PrefillConfig(64, 32, 4, 2, trans_k=True, tma=True)),
])
def test_prefill_configs_on_verification_rows(max_query_len, config):
    query, key, value, k_cache, v_cache, metadata = make_batch(
        [70, 6 + 33, 1 + 6, 40], [6, 6, 6, 23], 2, 4, 128, torch.bfloat16, num_padding_rows=2, seed=11)
    write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
    out = paged_prefill_attention(query, k_cache, v_cache, metadata.query_start_loc,
                                  metadata.seq_lens, metadata.block_tables, 128 ** -0.5,
                                  max_query_len=max_query_len, config=config, key=key, value=value)
    expected = paged_attention_reference(query, k_cache, v_cache, metadata.query_start_loc_cpu,
                                         metadata.seq_lens_cpu, metadata.block_tables, 128 ** -0.5)
    rows = metadata.query_start_loc_cpu[-1]
    assert_close(out[:rows], expected[:rows], torch.bfloat16)


def test_backend_routes_mixed_batch_through_prefill_kernel():
    # Two decode rows and a prefill chunk over a cached prefix, a padding sequence with an empty
    # context (its output must be zeros, as in the reference), and unowned padding rows.
    query, key, value, k_cache, v_cache, metadata = make_batch(
        [30, 48, 1 + 16, 0], [1, 20, 1, 1], 1, 4, 64, torch.float32, num_padding_rows=2, seed=7)
    assert not metadata.is_decode_only
    out, expected = run_both(TritonAttentionBackend(), query, key, value, k_cache, v_cache,
                             metadata, 0.125)
    assert_close(out, expected, torch.float32)


# Gemma-2's per-layer options on the paged kernels: (seq_lens, query_lens, group, head_dim, dtype,
# sliding window, logit soft cap, block_m, block_n). Windows shorter than the contexts, than a query
# tile and than a key tile (down to 1), caps that bite (scaled scores of these random vectors reach
# ~4), odd head dims, chunks after cached prefixes mixed with decode rows and fresh prompts.
WINDOW_SOFTCAP_PREFILL_CASES = [
    ([61, 1 + 37, 5], [29, 1, 5], 4, 40, torch.float32, 7, 1.5, 32, 16),
    ([23, 40], [23, 40], 1, 64, torch.float32, 19, None, 16, 16),
    ([33, 100], [33, 21], 2, 64, torch.float32, None, 2.0, 16, 16),
    ([9, 12], [9, 3], 1, 24, torch.float32, 1, 0.5, 16, 16),
    ([100, 7], [20, 7], 1, 32, torch.float32, 60, 2.0, 16, 16),       # masked, unmasked and diagonal tiles
    ([45, 70, 19], [1, 13, 1], 2, 64, torch.bfloat16, 30, 3.0, None, None),
]


@pytest.mark.parametrize("key_source", KEY_SOURCES)
@pytest.mark.parametrize("seq_lens,query_lens,group,head_dim,dtype,window,soft_cap,block_m,block_n",
                         WINDOW_SOFTCAP_PREFILL_CASES)
def test_prefill_window_and_soft_cap_match_reference(seq_lens, query_lens, group, head_dim, dtype, window,
                                                     soft_cap, block_m, block_n, key_source):
    query, key, value, k_cache, v_cache, metadata = make_batch(
        seq_lens, query_lens, 2, group, head_dim, dtype, block_size=8, num_padding_rows=2, seed=sum(seq_lens))
    scale = head_dim ** -0.5
    write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
    out = paged_prefill_attention(query, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens,
                                  metadata.block_tables, scale, max_query_len=metadata.max_query_len,
                                  block_m=block_m, block_n=block_n, sliding_window=window,
                                  logits_soft_cap=soft_cap,
                                  **({} if key_source == "paged" else
                                     dict(key=key, value=value, config=KEY_SOURCES[key_source])))
    expected = paged_attention_reference(query, k_cache, v_cache, metadata.query_start_loc_cpu,
                                         metadata.seq_lens_cpu, metadata.block_tables, scale,
                                         sliding_window=window, logits_soft_cap=soft_cap)
    rows = metadata.query_start_loc_cpu[-1]
    assert_close(out[:rows], expected[:rows], dtype)
    plain = paged_attention_reference(query, k_cache, v_cache, metadata.query_start_loc_cpu,
                                      metadata.seq_lens_cpu, metadata.block_tables, scale)
    assert (plain[:rows] - expected[:rows]).abs().max() > 0.05   # the options changed the result


# (seq_lens, group, head_dim, dtype, window, soft cap, decode partition): split-K with partitions
# wholly before the window (which must contribute nothing), unsplit, and an empty padding row.
WINDOW_SOFTCAP_DECODE_CASES = [
    ([37, 1, 70, 0], 2, 40, torch.float32, 16, 1.5, 16),
    ([37, 1, 70, 0], 4, 64, torch.float32, 5, None, 4096),
    ([50, 33], 4, 64, torch.bfloat16, 20, 2.0, 16),
    ([90, 17], 1, 32, torch.float32, None, 1.0, 32),
]


@pytest.mark.parametrize("seq_lens,group,head_dim,dtype,window,soft_cap,partition_size",
                         WINDOW_SOFTCAP_DECODE_CASES)
def test_decode_window_and_soft_cap_match_reference(seq_lens, group, head_dim, dtype, window, soft_cap,
                                                    partition_size):
    query, key, value, k_cache, v_cache, metadata = make_batch(
        seq_lens, [1] * len(seq_lens), 2, group, head_dim, dtype, seed=sum(seq_lens) + group)
    write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
    options = dict(sliding_window=window, logits_soft_cap=soft_cap)
    out = TritonAttentionBackend(decode_partition_size=partition_size).attend(
        query, k_cache, v_cache, metadata, head_dim ** -0.5, **options)
    expected = TorchAttentionBackend().attend(query, k_cache, v_cache, metadata, head_dim ** -0.5, **options)
    assert_close(out, expected, dtype)
    assert torch.equal(out[-1], torch.zeros_like(out[-1])) or seq_lens[-1] > 0


@pytest.mark.parametrize("seq_lens,query_lens,partition_size", [
    ([37, 1, 70], [1, 1, 1], 16),         # decode, split-K with partitions before the window
    ([37, 19, 6], [11, 19, 1], None),     # chunk after a cached prefix, a fresh prompt, a decode row
])
def test_window_and_soft_cap_on_fp8_cache(seq_lens, query_lens, partition_size):
    """The per-layer options compose with an fp8 cache's scales (the key scale sits inside the tanh)."""
    from minivllm.attention.torch_backend import quantize_kv
    query, key, value, k_cache, v_cache, metadata = make_batch(
        seq_lens, query_lens, 2, 2, 40, torch.float32, block_size=8, seed=sum(seq_lens))
    k_scale, v_scale = 0.03, 0.02
    k_cache = quantize_kv(k_cache, torch.float8_e4m3fn, k_scale)
    v_cache = quantize_kv(v_cache, torch.float8_e4m3fn, v_scale)
    write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
    options = dict(sliding_window=9, logits_soft_cap=1.5)
    out = TritonAttentionBackend(decode_partition_size=partition_size).attend(
        query, k_cache, v_cache, metadata, 40 ** -0.5, k_scale, v_scale, **options)
    expected = TorchAttentionBackend().attend(query, k_cache, v_cache, metadata, 40 ** -0.5, k_scale, v_scale,
                                              **options)
    rows = metadata.query_start_loc_cpu[-1]
    assert_close(out[:rows], expected[:rows], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_matches_hf_semantics(dtype):
    generator = torch.Generator().manual_seed(11)
    x = (3 * torch.randn(2, 3, 100, generator=generator)).to(dtype).to(DEVICE)   # odd hidden size
    residual = torch.randn(2, 3, 100, generator=generator).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(100, generator=generator)).to(dtype).to(DEVICE)
    out, expected = rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)
    assert_close(out, expected, dtype)
    assert_rounds_like_reference(out, expected, dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert out.shape == x.shape and new_residual.dtype == dtype
    assert_close(out, expected_out, dtype)
    assert_rounds_like_reference(out, expected_out, dtype)
    assert_close(new_residual, expected_residual, dtype)
    if dtype != torch.bfloat16:  # the interpreter truncates fp32 -> bf16; fp16 rounds properly
        assert torch.equal(new_residual, expected_residual)   # one rounding of the sum, as torch
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)   # out of place
    stream = torch.empty_like(x)   # a buffer a later kernel was promised (layers/fusion.PendingNorm's stream)
    again, returned = fused_add_rms_norm(x, residual, weight, 1e-6, residual_out=stream)
    assert returned.data_ptr() == stream.data_ptr() and torch.equal(stream, new_residual) and torch.equal(again, out)
    with pytest.raises(ValueError, match="residual_out"):
        fused_add_rms_norm(x, residual, weight, 1e-6, residual_out=torch.empty_like(x).transpose(0, 1))


def test_rms_norm_promotes_to_fp32_weight_like_hf():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=generator).to(torch.float16).to(DEVICE)
    weight = (torch.rand(64, generator=generator) + 0.5).to(DEVICE)
    out = rms_norm(x, weight, 1e-5)
    expected = rms_norm_reference(x, weight, 1e-5)
    assert out.dtype == expected.dtype == torch.float32
    # the normalised row is rounded to fp16 before the fp32 scale, so an rsqrt an ulp apart may move
    # an element by an fp16 ulp; all but 1% of the elements must match the reference bit for bit
    assert_close(out, expected, torch.float16)
    assert_rounds_like_reference(out, expected, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    x = (2 * torch.randn(3, 5, 2 * 1100)).to(dtype).to(DEVICE)   # two column blocks, ragged end
    out = silu_and_mul(x)
    assert out.shape == (3, 5, 1100)
    assert_close(out, silu_and_mul_reference(x), dtype)
    assert_rounds_like_reference(out, silu_and_mul_reference(x), dtype)


def test_fusions_reject_bad_shapes():
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError):
        rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(9, device=DEVICE), 1e-6)


# ----- realistic shapes on a GPU (the lead runs these on an H100) -----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (8, 1, 128), (3, 3, 32), (20, 10, 32)])
def test_rotary_in_place_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    from minivllm.kernels.rotary import apply_rotary_
    from minivllm.layers.rotary import get_rope
    rope = get_rope(head_dim, 300, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    rope.to(DEVICE)
    tokens = 7
    # q and k as strided views of one fused qkv tensor, as the attention layer hands them over.
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q = qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    positions = torch.tensor([0, 1, 17, 63, 64, 150, 299], device=DEVICE)
    q_ref, k_ref = rope.forward_reference(positions, q.clone(), k.clone())
    apply_rotary_(positions, q, k, rope.cos_sin_cache)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_rotary_with_qk_norms_matches_norms_then_rotation(dtype, gemma):
    """Qwen3's (and Gemma-3's `(1 + w)`) per-head q/k RMSNorm run in the rotation's kernel: equal to the norm
    layers followed by the reference rotation, on strided views of one qkv tensor, v untouched."""
    from minivllm.kernels.rotary import apply_rotary_
    from minivllm.layers.layernorm import GemmaRMSNorm, RMSNorm
    from minivllm.layers.rotary import get_rope
    num_heads, num_kv_heads, head_dim, tokens = 5, 2, 64, 6
    rope = get_rope(head_dim, 128, 1e6, None).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    norms = [(GemmaRMSNorm if gemma else RMSNorm)(head_dim, eps=1e-6) for _ in range(2)]
    for norm in norms:
        norm.weight.data = (torch.randn(head_dim, generator=g) * 0.3 + (0.0 if gemma else 1.0)).to(dtype)
        norm.to(DEVICE).use_triton = False
    qkv = (3 * torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)).to(DEVICE, dtype)
    q = qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    positions = torch.tensor([0, 3, 17, 64, 100, 127], device=DEVICE)
    q_ref, k_ref = rope.forward_reference(positions, norms[0](q.clone()), norms[1](k.clone()))
    apply_rotary_(positions, q, k, rope.cos_sin_cache, (norms[0].weight, norms[1].weight), 1e-6, gemma_norm=gemma)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)


@pytest.mark.parametrize("norms", [False, True])
def test_rotary_stores_rotated_keys_and_values_in_the_paged_cache(norms):
    """With a KV cache target the kernel also writes the rotated k and the untouched v at each token's slot, as
    write_kv does after a separate rotation; slot -1 (a padding row) writes nothing."""
    from minivllm.attention.torch_backend import write_kv_reference
    from minivllm.kernels.rotary import apply_rotary_
    from minivllm.layers.rotary import get_rope
    num_heads, num_kv_heads, head_dim, tokens, block_size = 12, 10, 32, 5, 4   # more heads than one program takes
    rope = get_rope(head_dim, 64, 10000.0, None).to(DEVICE)
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(DEVICE)
    q = qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
    weights = (1.0 + 0.2 * torch.randn(2, head_dim, generator=g)).to(DEVICE) if norms else None
    positions = torch.tensor([3, 9, 0, 40, 12], device=DEVICE)
    slots = torch.tensor([5, -1, 0, 13, 7], device=DEVICE)
    k_cache = torch.zeros(4, block_size, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_(positions, q_ref, k_ref, rope.cos_sin_cache, None if weights is None else (weights[0], weights[1]),
                  1e-6)
    write_kv_reference(k_ref, v, expected_k, expected_v, slots)
    apply_rotary_(positions, q, k, rope.cos_sin_cache, None if weights is None else (weights[0], weights[1]), 1e-6,
                  value=v, kv_cache=(k_cache, v_cache, slots, num_kv_heads))
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("partition_size", [None, 512])
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode_realistic(batch, partition_size):
    seq_lens = torch.randint(1, 4097, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    seq_lens[0] = 4096
    query, key, value, k_cache, v_cache, metadata = make_batch(
        seq_lens, [1] * batch, 8, 4, 128, torch.bfloat16, seed=batch)
    backend = TritonAttentionBackend(decode_partition_size=partition_size)
    out, expected = run_both(backend, query, key, value, k_cache, v_cache, metadata, 128 ** -0.5)
    assert_close(out, expected, torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_prefill_realistic(dtype):
    # Decodes, a fresh 1000-token prompt, and a 700-token chunk after a 3000-token cached prefix.
    seq_lens = [4096] * 6 + [1000, 3700]
    query_lens = [1] * 6 + [1000, 700]
    query, key, value, k_cache, v_cache, metadata = make_batch(
        seq_lens, query_lens, 8, 4, 128, dtype, num_padding_rows=5, seed=5)
    out, expected = run_both(TritonAttentionBackend(), query, key, value, k_cache, v_cache,
                             metadata, 128 ** -0.5)
    assert_close(out, expected, dtype)


@pytest.mark.gpu
@requires_cuda
def test_gpu_verification_replays_in_a_cuda_graph():
    # One capture serves steps whose lengths and offsets change (as the runner's mixed graphs do):
    # the kernel reads them on device and must not depend on their values at capture time.
    batch = 8
    query, _, _, k_cache, v_cache, metadata = make_batch(
        [2048] * batch, [6] * batch, 8, 4, 128, torch.bfloat16, seed=13)
    seq_lens, query_start_loc = metadata.seq_lens, metadata.query_start_loc

    def attend():
        return paged_prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens,
                                       metadata.block_tables, 128 ** -0.5, max_query_len=6)
    attend()   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    for query_lens, lengths in (([6] * batch, [6, 300, 2048, 9, 100, 2000, 17, 1024]),
                                ([1, 2, 6, 6, 3, 4, 5, 21], [1, 2048, 6, 700, 3, 64, 5, 1500])):
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        query_start_loc.copy_(torch.tensor(starts, dtype=torch.int32))
        graph.replay()
        expected = paged_attention_reference(query, k_cache, v_cache, starts, lengths,
                                             metadata.block_tables, 128 ** -0.5)
        assert_close(out[:starts[-1]], expected[:starts[-1]], torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("seq_lens,query_lens", [
    ([1100, 1900, 37], [1100, 300, 1]),    # long prompts: 128-row tiles, chunk keys from key/value
    ([700, 1000, 1], [700, 91, 1]),        # short prompts and a prefix hit
])
def test_gpu_prefill_with_step_kv_matches_reference(seq_lens, query_lens):
    # The engine's call: this step's K/V passed beside the cache they were just written to.
    query, key, value, k_cache, v_cache, metadata = make_batch(
        seq_lens, query_lens, 8, 4, 128, torch.bfloat16, num_padding_rows=5, seed=len(seq_lens))
    out, expected = run_both(TritonAttentionBackend(), query, key, value, k_cache, v_cache,
                             metadata, 128 ** -0.5)
    assert_close(out, expected, torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_gpu_prefill_long_prompt_with_tma_replays_in_a_cuda_graph():
    # Long prompts read this step's K/V through tensor descriptors built on the host at capture:
    # a replay must read the (same) tensors' new contents, as the runner's mixed graphs refill them.
    query, key, value, k_cache, v_cache, metadata = make_batch(
        [1500, 1300 + 200], [1500, 1300], 8, 4, 128, torch.bfloat16, num_padding_rows=3, seed=21)

    def attend():
        return paged_prefill_attention(query, k_cache, v_cache, metadata.query_start_loc,
                                       metadata.seq_lens, metadata.block_tables, 128 ** -0.5,
                                       max_query_len=1500, key=key, value=value)
    assert _tile_config(128, torch.bfloat16, 1500).tma
    write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
    attend()   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    for _ in range(2):
        for x in (query, key, value):
            x.normal_()
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        graph.replay()
        expected = paged_attention_reference(query, k_cache, v_cache, metadata.query_start_loc_cpu,
                                             metadata.seq_lens_cpu, metadata.block_tables, 128 ** -0.5)
        rows = metadata.query_start_loc_cpu[-1]
        assert_close(out[:rows], expected[:rows], torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_gpu_decode_replays_in_a_cuda_graph():
    batch, max_len = 4, 2048   # 4 x 8 programs: split-K is on
    query, _, _, k_cache, v_cache, metadata = make_batch(
        [max_len] * batch, [1] * batch, 8, 4, 128, torch.bfloat16, seed=9)
    backend = TritonAttentionBackend()
    seq_lens = metadata.seq_lens
    seq_lens.fill_(7)
    backend.attend(query, k_cache, v_cache, metadata, 128 ** -0.5)   # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(query, k_cache, v_cache, metadata, 128 ** -0.5)
    for lengths in ([7, 300, 2048, 1], [2048, 2048, 17, 1000]):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        expected = paged_attention_reference(query, k_cache, v_cache, list(range(batch + 1)),
                                             lengths, metadata.block_tables, 128 ** -0.5)
        assert_close(out, expected, torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("partition_size", [None, 512])
def test_gpu_window_and_soft_cap_realistic(partition_size):
    """Gemma-2-9B's attention (head_dim 256, 16 query / 8 KV heads, window 4096, cap 50, scale 256^-0.5) in
    bf16, queries scaled up so that the cap bites: decode rows past the window (split-K partitions wholly
    before it), then prompt chunks whose query tiles straddle the window's start, mixed with a decode row."""
    options = dict(sliding_window=4096, logits_soft_cap=50.0)
    scale = 256 ** -0.5
    for seq_lens, query_lens in (([6000, 4097, 300, 8192], [1, 1, 1, 1]), ([6000, 5000, 1000], [700, 1, 1000])):
        query, key, value, k_cache, v_cache, metadata = make_batch(
            seq_lens, query_lens, 8, 2, 256, torch.bfloat16, num_padding_rows=3, seed=sum(seq_lens))
        query = query * 8
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        out = TritonAttentionBackend(decode_partition_size=partition_size).attend(
            query, k_cache, v_cache, metadata, scale, **options, key=key, value=value)
        expected = TorchAttentionBackend().attend(query, k_cache, v_cache, metadata, scale, **options)
        rows = metadata.query_start_loc_cpu[-1]
        assert_close(out[:rows], expected[:rows], torch.bfloat16)


@pytest.mark.parametrize("query_lens", [[6, 3, 5], [4, 4, 4]])   # uneven, and k + 1 each (no index copy)
@pytest.mark.parametrize("partition_size", [16, 4096])
def test_short_queries_as_decode_rows_match_causal_attention(partition_size, query_lens):
    """A verify step (several query tokens per sequence) replayed as one decode row per token, as the
    CUDA graph runner does: row t over its sequence's first positions[t] + 1 tokens is causal attention."""
    from minivllm.worker.cuda_graph import as_decode_rows
    seq_lens = [37, 70, 5]
    query, key, value, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, 2, 4, 64, torch.float32)
    positions = torch.tensor([p for s, q in zip(seq_lens, query_lens) for p in range(s - q, s)], device=DEVICE)
    _, expected = run_both(TritonAttentionBackend(), query, key, value, k_cache.clone(), v_cache.clone(),
                           metadata, 0.125)
    rows = as_decode_rows(metadata, positions)
    write_kv(key, value, k_cache, v_cache, rows.slot_mapping)
    out = paged_decode_attention(query, k_cache, v_cache, rows.block_tables, rows.seq_lens, 0.125,
                                 partition_size=partition_size)
    assert_close(out, expected, torch.float32)
