"""BlockManager: the paged KV-cache block pool, with reference counts, copy-on-write and prefix caching.

Owns which physical block backs each logical block of every sequence (`Sequence.block_table`), the
reference count of each block, the hash -> block map of the prefix cache and the free queue. It
never reads or writes KV data: copies it decides on (copy-on-write) are handed to the runner as
`(src, dst)` pairs. It must not touch a sequence's status or `num_computed_tokens`.

The free queue holds every block with ref_count 0, least recently freed first. A freed block keeps
its hash, so it stays a prefix-cache hit until the queue hands it out again: the free queue is also
the LRU list of the cache.

Collision safety: the chained hash is only an index. A hit also requires the block's own token ids
to match and its recorded parent to be the very cache entry matched one block earlier (`cache_id`,
never reused), so by induction a hit's whole prefix is equal token by token.
"""
from __future__ import annotations

import itertools
import operator
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence as SequenceLike

import numpy as np

from minivllm.core.sequence import Sequence
from minivllm.core.swap import CpuBlockPool

_ROOT = -1  # parent_cache_id of the first block of a base-model sequence (-1 - id under an adapter)
_REF_COUNT = operator.attrgetter("ref_count")


def _chain_root(seq: Sequence) -> tuple[int | None, int]:
    """(parent hash, parent cache id) of a sequence's first block. Each adapter has its own root: KV computed
    under one adapter is never a hit for another, even on a hash collision."""
    lora_id = seq.lora_int_id
    return (None, _ROOT) if not lora_id else (hash(("lora", lora_id)), _ROOT - lora_id)


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: it covers the whole prefix through `parent_hash`."""
    return hash((parent_hash, token_ids))


class KVCacheBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "cache_id", "parent_cache_id")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self._reset_hash()

    def _reset_hash(self) -> None:
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.cache_id: int | None = None         # unique per registration in the cache
        self.parent_cache_id: int | None = None  # cache_id of the previous block's content, or _ROOT

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Keys only (values unused): O(1) pop from the head and removal from the middle on a cache hit.
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_hash_to_block: dict[int, int] = {}
        # Per sequence: (chain hash, cache_id of that exact content or None) of each full computed block.
        self._seq_block_hashes: dict[int, list[tuple[int, int | None]]] = {}
        self._blocks_to_copy: list[tuple[int, int]] = []
        self._cache_ids = itertools.count()
        self.prefix_cache_queries = 0  # in tokens
        self.prefix_cache_hits = 0     # in tokens
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)  # swap space (preemption_mode="swap")
        self._blocks_to_swap_out: list[tuple[int, int]] = []
        self._blocks_to_swap_in: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_block_queue) / self.num_blocks

    # ---- prefix cache -------------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest chain of cached full blocks that prefixes `seq`, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return [], 0
        assert not seq.block_table, "prefix lookup is only for a sequence that holds no blocks"
        bs = self.block_size
        hit_blocks: list[int] = []
        parent_hash, parent_id = _chain_root(seq)
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block_hash = hash_block_tokens(parent_hash, tokens)
            block_id = self.cached_block_hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_cache_id != parent_id:
                break  # a hash collision, not a hit
            hit_blocks.append(block_id)
            parent_hash, parent_id = block_hash, block.cache_id
        num_hit_tokens = len(hit_blocks) * bs
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hit_blocks, num_hit_tokens

    def cache_blocks(self, seq: Sequence) -> None:
        """Register every newly full, fully computed block of `seq` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        chain = self._seq_block_hashes.setdefault(seq.seq_id, [])
        # Only blocks whose token ids are all known: with async scheduling the last computed position
        # may hold a token still being sampled.
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        assert num_full <= len(seq.block_table), "computed tokens beyond the block table"
        for i in range(len(chain), num_full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent_hash, parent_id = chain[-1] if chain else _chain_root(seq)
            block_hash = hash_block_tokens(parent_hash, tokens)
            cache_id = None  # stays None when the prefix has no exact cache identity (after a collision)
            if parent_id is not None:
                existing = self.cached_block_hash_to_block.get(block_hash)
                if existing is None:
                    block = self.blocks[seq.block_table[i]]
                    assert block.block_hash is None, f"{block} already hashed at position {i}"
                    block.block_hash, block.token_ids = block_hash, tokens
                    block.parent_cache_id, block.cache_id = parent_id, next(self._cache_ids)
                    self.cached_block_hash_to_block[block_hash] = block.block_id
                    cache_id = block.cache_id
                else:
                    # Same content computed by another sequence (keep the first copy), or a collision.
                    other = self.blocks[existing]
                    if other.token_ids == tokens and other.parent_cache_id == parent_id:
                        cache_id = other.cache_id
            chain.append((block_hash, cache_id))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if any(block.ref_count > 0 for block in self.blocks):
            return False
        for block_id in self.cached_block_hash_to_block.values():
            self.blocks[block_id]._reset_hash()
        self.cached_block_hash_to_block.clear()
        self._seq_block_hashes.clear()
        return True

    # ---- allocation ---------------------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: SequenceLike[int] = ()) -> bool:
        """Grow `seq.block_table` to hold its computed tokens, `computed_blocks` and `num_new_tokens` more.

        All or nothing: returns False, changing nothing, when the free queue is too short.
        """
        bs = self.block_size
        computed_blocks = list(computed_blocks)
        assert not computed_blocks or not seq.block_table, "cache hits are only taken on admission"
        num_computed = seq.num_computed_tokens + len(computed_blocks) * bs
        num_held = len(seq.block_table) + len(computed_blocks)
        num_new_blocks = max(0, _cdiv(num_computed + num_new_tokens, bs) - num_held)
        # The block receiving the first new token may be shared (after a fork): writing it in place
        # would corrupt the siblings' KV, so this sequence gets a private copy.
        write_index = num_computed // bs
        needs_copy = (num_new_tokens > 0 and write_index < len(seq.block_table)
                      and self.blocks[seq.block_table[write_index]].ref_count > 1)
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks + needs_copy + num_revived > len(self.free_block_queue):
            return False

        if computed_blocks:
            for block_id in computed_blocks:
                self._incref(block_id)
            seq.block_table.extend(computed_blocks)
            self._seq_block_hashes[seq.seq_id] = [
                (self.blocks[b].block_hash, self.blocks[b].cache_id) for b in computed_blocks]
        if needs_copy:
            old = seq.block_table[write_index]
            new = self._take_free_block()
            seq.block_table[write_index] = new
            self.blocks[old].ref_count -= 1
            assert self.blocks[old].ref_count > 0
            self._blocks_to_copy.append((old, new))
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        return True

    def free(self, seq: Sequence) -> None:
        """Release the blocks of `seq`, tail first, so its last blocks are the first evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"{block} freed more often than referenced"
            if block.ref_count == 0:
                self.free_block_queue[block_id] = None
                if block.block_hash is None:
                    # Nothing cached in it: hand it out before any block that could still be a hit.
                    self.free_block_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        self._seq_block_hashes.pop(seq.seq_id, None)

    def trim(self, seq: Sequence) -> None:
        """Free the tail blocks `seq` holds beyond its tokens (slots of rejected speculative drafts)."""
        keep = _cdiv(max(seq.num_tokens, seq.num_computed_tokens), self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.block_hash is None, f"{block} was not private to {seq}"
            self.free_block_queue[block.block_id] = None
            self.free_block_queue.move_to_end(block.block_id, last=False)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks; the first write into a shared partial block copies it."""
        assert not child.block_table
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self._incref(block_id)
        if parent.seq_id in self._seq_block_hashes:
            self._seq_block_hashes[child.seq_id] = list(self._seq_block_hashes[parent.seq_id])

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        copies, self._blocks_to_copy = self._blocks_to_copy, []
        return copies

    # ---- swapping (core/swap.py holds the CPU side) ----------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        """Only a sequence whose blocks are all its own: a shared block would have to stay on the GPU."""
        return (bool(seq.block_table) and len(seq.block_table) <= self.cpu_pool.num_free_blocks
                and all(self.blocks[b].ref_count == 1 for b in seq.block_table))

    def swap_out(self, seq: Sequence) -> None:
        """Map each GPU block of `seq` to a CPU block (the copies are taken with `take_swaps`), free them."""
        assert self.can_swap_out(seq)
        cpu_table = self.cpu_pool.take(seq.seq_id, len(seq.block_table))
        self._blocks_to_swap_out += zip(seq.block_table, cpu_table)
        self.free(seq)

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for the swapped blocks and for the next `num_new_tokens` of `seq`."""
        num_held = len(self.cpu_pool.tables[seq.seq_id])
        num_needed = max(num_held, _cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size))
        return num_needed <= len(self.free_block_queue)

    def swap_in(self, seq: Sequence) -> None:
        assert not seq.block_table
        cpu_table = self.cpu_pool.release(seq.seq_id)
        seq.block_table = [self._take_free_block() for _ in cpu_table]
        self._blocks_to_swap_in += zip(cpu_table, seq.block_table)

    def free_swapped(self, seq: Sequence) -> None:
        """A swapped sequence ended (aborted): its CPU blocks go back."""
        self.cpu_pool.release(seq.seq_id)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(GPU -> CPU pairs, CPU -> GPU pairs) decided since the last call."""
        swaps = self._blocks_to_swap_out, self._blocks_to_swap_in
        self._blocks_to_swap_out, self._blocks_to_swap_in = [], []
        return swaps

    def _incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_queue[block_id]  # a cache hit on a free block: it is in use again
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cache entry: the block is about to be overwritten
            assert self.cached_block_hash_to_block[block.block_hash] == block_id
            del self.cached_block_hash_to_block[block.block_hash]
            block._reset_hash()
        block.ref_count = 1
        return block_id

    # ---- observation --------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The pool for a dashboard, one character per block: '.' free, 'c' free but still a prefix-cache
        hit (LRU), '1'..'9' in use by that many sequences (9: nine or more). O(blocks), no per-block objects."""
        refs = np.fromiter(map(_REF_COUNT, self.blocks), dtype=np.int64, count=self.num_blocks)
        codes = (np.minimum(refs, 9) + ord("0")).astype(np.uint8)
        codes[refs == 0] = ord(".")
        cached = np.fromiter(self.cached_block_hash_to_block.values(), dtype=np.int64)
        codes[cached[refs[cached] == 0]] = ord("c")
        return {"num_blocks": self.num_blocks, "block_size": self.block_size, "blocks": codes.tobytes().decode("ascii"),
                "num_free": len(self.free_block_queue), "num_cached": len(self.cached_block_hash_to_block),
                "num_shared": int((refs > 1).sum())}

    # ---- checks -------------------------------------------------------------------------------

    def check_integrity(self, seqs: Iterable[Sequence] | None = None,
                        swapped: Iterable[Sequence] | None = None) -> None:
        """Assert the pool's invariants; with `seqs` (all sequences holding blocks), also exact ref counts;
        with `swapped` (all swapped-out sequences), also which sequences hold CPU blocks."""
        self.cpu_pool.check_integrity(None if swapped is None else [seq.seq_id for seq in swapped])
        num_in_use = 0
        for block in self.blocks:
            assert block.ref_count >= 0, f"{block} has a negative ref count"
            assert (block.ref_count == 0) == (block.block_id in self.free_block_queue), \
                f"{block}: free-queue membership disagrees with its ref count"
            num_in_use += block.ref_count > 0
            if block.block_hash is None:
                assert block.token_ids is None and block.cache_id is None, f"{block} half hashed"
            else:
                assert self.cached_block_hash_to_block.get(block.block_hash) == block.block_id, \
                    f"{block} has a hash the cache does not map to it"
        assert num_in_use + len(self.free_block_queue) == self.num_blocks, "block counts do not add up"
        for block_hash, block_id in self.cached_block_hash_to_block.items():
            assert self.blocks[block_id].block_hash == block_hash, \
                f"hash entry points to {self.blocks[block_id]}, which does not hold it"
        if seqs is not None:
            seqs = list(seqs)
            refs = Counter(block_id for seq in seqs for block_id in seq.block_table)
            for block in self.blocks:
                assert refs[block.block_id] == block.ref_count, \
                    f"{block} is referenced by {refs[block.block_id]} block tables"
            live = {seq.seq_id for seq in seqs}
            assert set(self._seq_block_hashes) <= live, "hash progress kept for a released sequence"
