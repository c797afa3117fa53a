"""BlockManager on plain Python sequences: ref counts, free queue, copy-on-write, prefix cache, LRU."""
import random

import pytest

from minivllm.core import block_manager as block_manager_module
from minivllm.core.block_manager import BlockManager
from minivllm.core.sequence import SequenceGroup
from minivllm.sampling_params import SamplingParams

_ids = iter(range(10**9))


def make_seq(token_ids, n=1):
    group = SequenceGroup(f"req-{next(_ids)}", None, list(token_ids), SamplingParams(n=n))
    return group.seqs[0]


def compute(bm, seq, num_tokens=None):
    """What a step does for `seq`: allocate, compute up to `num_tokens` (default: all), hash full blocks."""
    target = seq.num_tokens if num_tokens is None else num_tokens
    assert bm.allocate_slots(seq, target - seq.num_computed_tokens)
    seq.num_computed_tokens = target
    bm.cache_blocks(seq)


def refs(bm, seq):
    return [bm.blocks[b].ref_count for b in seq.block_table]


def test_ref_counts_and_free_queue_through_allocate_fork_free():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent = make_seq(range(10))
    assert bm.allocate_slots(parent, 10)
    assert len(parent.block_table) == 3 and bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    bm.check_integrity([parent])
    parent.num_computed_tokens = 10
    bm.cache_blocks(parent)

    child = parent.fork(index=1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and refs(bm, child) == [2, 2, 2]
    assert bm.num_free_blocks == 7
    bm.check_integrity([parent, child])

    bm.free(parent)
    assert parent.block_table == [] and refs(bm, child) == [1, 1, 1]
    bm.check_integrity([child])
    bm.free(child)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    bm.check_integrity([])


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    first = make_seq(range(12))
    assert bm.allocate_slots(first, 12)
    second = make_seq(range(100, 108))
    assert not bm.allocate_slots(second, 8)  # needs 2 blocks, 1 is free
    assert second.block_table == [] and bm.num_free_blocks == 1
    bm.check_integrity([first, second])
    # Growing by tokens that still fit the last block needs no new block.
    first.num_computed_tokens = 11
    assert bm.allocate_slots(first, 1) and len(first.block_table) == 3


def test_copy_on_write_only_for_shared_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(range(6))  # one full block, one holding 2 tokens
    compute(bm, parent)
    child = parent.fork(index=1)
    bm.fork(parent, child)
    full, partial = parent.block_table
    assert bm.take_blocks_to_copy() == []

    parent.append_token(50)
    assert bm.allocate_slots(parent, 1)  # writes row 2 of the shared partial block
    assert parent.block_table[0] == full and parent.block_table[1] != partial
    assert bm.take_blocks_to_copy() == [(partial, parent.block_table[1])]
    assert bm.blocks[partial].ref_count == 1 and bm.blocks[full].ref_count == 2
    bm.check_integrity([parent, child])

    child.append_token(60)
    assert bm.allocate_slots(child, 1)  # the partial block is private to the child now
    assert child.block_table == [full, partial] and bm.take_blocks_to_copy() == []
    bm.check_integrity([parent, child])


def test_no_copy_for_full_shared_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(range(8))  # exactly two full blocks
    compute(bm, parent)
    child = parent.fork(index=1)
    bm.fork(parent, child)
    for seq, token in ((parent, 1), (child, 2)):
        seq.append_token(token)
        assert bm.allocate_slots(seq, 1)
    assert bm.take_blocks_to_copy() == []
    assert parent.block_table[:2] == child.block_table[:2] and parent.block_table[2] != child.block_table[2]
    assert refs(bm, parent) == [2, 2, 1]
    bm.check_integrity([parent, child])


def test_copy_on_write_fails_cleanly_without_a_free_block():
    bm = BlockManager(num_blocks=2, block_size=4)
    parent = make_seq(range(6))
    compute(bm, parent)
    child = parent.fork(index=1)
    bm.fork(parent, child)
    parent.append_token(9)
    assert not bm.allocate_slots(parent, 1)  # the private copy needs a block
    assert bm.take_blocks_to_copy() == [] and refs(bm, parent) == [2, 2]
    bm.check_integrity([parent, child])


def test_prefix_hit_reuses_exactly_the_full_blocks():
    bm = BlockManager(num_blocks=20, block_size=16)
    shared = list(range(48))
    first = make_seq(shared + [900, 901, 902, 903, 904])
    assert bm.get_computed_blocks(first) == ([], 0)
    compute(bm, first)
    second = make_seq(shared + [700] * 7)
    blocks, num_hit = bm.get_computed_blocks(second)
    assert blocks == first.block_table[:3] and num_hit == 48
    assert bm.prefix_cache_queries == 53 + 55 and bm.prefix_cache_hits == 48
    assert bm.allocate_slots(second, 55 - 48, blocks)
    assert second.block_table[:3] == first.block_table[:3] and second.block_table[3] != first.block_table[3]
    assert refs(bm, second) == [2, 2, 2, 1]
    bm.check_integrity([first, second])


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=20, block_size=16)
    first = make_seq(range(64))
    compute(bm, first)
    assert bm.get_computed_blocks(make_seq(range(48)))[1] == 32   # a whole-block prompt recomputes its last block
    assert bm.get_computed_blocks(make_seq(range(49)))[1] == 48
    assert bm.get_computed_blocks(make_seq(range(1)))[1] == 0
    assert bm.prefix_cache_queries == 48 + 49 + 1 and bm.prefix_cache_hits == 80


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = make_seq(range(12))
    compute(bm, first)
    assert bm.cached_block_hash_to_block == {}
    assert bm.get_computed_blocks(make_seq(range(13))) == ([], 0)
    assert bm.prefix_cache_queries == 0
    bm.free(first)
    bm.check_integrity([])


def test_lru_eviction_order_and_hit_on_free_cached_block():
    bm = BlockManager(num_blocks=6, block_size=4)
    x = make_seq(range(0, 8))
    y = make_seq(range(100, 108))
    compute(bm, x)
    compute(bm, y)
    x0, x1 = x.block_table
    y0, y1 = y.block_table
    bm.free(x)
    bm.free(y)
    # Never-used blocks first, then x (freed earlier; its tail before its head), then y.
    assert list(bm.free_block_queue)[-4:] == [x1, x0, y1, y0]
    assert len(bm.cached_block_hash_to_block) == 4

    z = make_seq(range(200, 212))
    assert bm.allocate_slots(z, 12)  # takes the 2 unused blocks and x1
    assert x1 in z.block_table and bm.blocks[x1].block_hash is None
    assert bm.get_computed_blocks(make_seq(range(0, 9)))[1] == 4  # x0 still hits, x1 does not
    bm.check_integrity([z])

    # A hit on y's free cached blocks takes them out of the free queue, without evicting them.
    y_again = make_seq(list(range(100, 108)) + [5])
    blocks, num_hit = bm.get_computed_blocks(y_again)
    assert blocks == [y0, y1] and num_hit == 8
    free_before = bm.num_free_blocks
    assert bm.allocate_slots(y_again, 1, blocks)
    assert y0 not in bm.free_block_queue and y1 not in bm.free_block_queue
    assert bm.num_free_blocks == free_before - 3  # two revived + one new, which evicted x0
    assert bm.blocks[x0].block_hash is None and y_again.block_table[2] == x0
    bm.check_integrity([z, y_again])


def test_hash_collisions_never_give_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block_tokens", lambda parent, tokens: 12345)
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    bm.check_integrity([a])
    assert bm.get_computed_blocks(make_seq([9, 9, 9, 9, 9, 9, 9, 9, 9])) == ([], 0)
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 5])) == ([a.block_table[0]], 4)
    # Same block content at another position: the chain check refuses to reuse block 0 as block 1.
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 0])) == ([a.block_table[0]], 4)


def test_collision_deep_in_the_chain_cuts_the_chain(monkeypatch):
    # Two different first blocks collide, so equal second blocks also get equal chain hashes.
    real = block_manager_module.hash_block_tokens

    def colliding(parent, tokens):
        return 777 if tokens in ((1, 1), (2, 2)) else real(parent, tokens)

    monkeypatch.setattr(block_manager_module, "hash_block_tokens", colliding)
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 1, 5, 5, 0])
    compute(bm, a)
    a0, a1, _ = a.block_table
    bm.free(a)
    # Evict a's first block while its second stays cached (any eviction order must stay safe).
    bm.free_block_queue.move_to_end(a0, last=False)
    filler = make_seq([3])
    assert bm.allocate_slots(filler, 1) and filler.block_table == [a0]
    b = make_seq([2, 2, 5, 5, 0])
    compute(bm, b)  # b's first block takes hash 777; its second finds a1 under the same hash
    bm.check_integrity([filler, b])
    # a1 holds (5, 5) computed after (1, 1): it must not serve a prompt starting (2, 2).
    assert bm.get_computed_blocks(make_seq([2, 2, 5, 5, 1])) == ([b.block_table[0]], 2)


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(9))
    compute(bm, seq)
    assert not bm.reset_prefix_cache()
    bm.free(seq)
    assert bm.reset_prefix_cache()
    assert bm.get_computed_blocks(make_seq(range(9))) == ([], 0)
    bm.check_integrity([])


def test_check_integrity_detects_corruption():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(range(8))
    compute(bm, seq)
    bm.blocks[seq.block_table[0]].ref_count = 0  # now free by count but not queued
    with pytest.raises(AssertionError):
        bm.check_integrity()
    bm.blocks[seq.block_table[0]].ref_count = 2
    bm.check_integrity()
    with pytest.raises(AssertionError):
        bm.check_integrity([seq])  # one table references it, not two
    bm.blocks[seq.block_table[0]].ref_count = 1
    some_hash = next(iter(bm.cached_block_hash_to_block))
    bm.cached_block_hash_to_block[some_hash] = 3  # an entry pointing to a block without that hash
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_random_operations_keep_invariants():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=24, block_size=4)
    live = []
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for _ in range(400):
        op = rng.random()
        if op < 0.35 or not live:  # admit a new sequence, with a prefix-cache lookup
            seq = make_seq(rng.choice(prefixes)[:rng.randrange(1, 13)] + [rng.randrange(50)])
            blocks, num_hit = bm.get_computed_blocks(seq)
            if bm.allocate_slots(seq, seq.num_tokens - num_hit, blocks):
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_blocks(seq)
                live.append(seq)
        elif op < 0.7:  # decode one token
            seq = rng.choice(live)
            seq.append_token(rng.randrange(50))
            if bm.allocate_slots(seq, 1):
                seq.num_computed_tokens += 1
                bm.cache_blocks(seq)
            else:
                seq.token_ids.pop()
        elif op < 0.8:
            parent = rng.choice(live)
            child = parent.fork(index=1)
            bm.fork(parent, child)
            live.append(child)
        else:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_integrity(live)
        bm.take_blocks_to_copy()
    for seq in live:
        bm.free(seq)
    bm.check_integrity([])
    assert bm.num_free_blocks == 24


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(range(6))  # block 0 full and cached, block 1 partial: nothing to keep
    compute(bm, seq)
    full, partial = seq.block_table
    bm.free(seq)
    other = make_seq([99])
    assert bm.allocate_slots(other, 1) and other.block_table == [partial]
    assert bm.get_computed_blocks(make_seq(range(5)))[1] == 4
    bm.check_integrity([other])
