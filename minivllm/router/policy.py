"""Which replica gets a request: least outstanding tokens, with prefix affinity.

Pure Python, no I/O. The router cannot see the replicas' KV caches, so it remembers where it sent each
prompt prefix: a prompt is cut into chunks of `chunk_chars` characters (about one KV block of 16
tokens at ~4 characters a token) and the hashes of its first 1..K chunk prefixes map to the replica
that served it. A new request goes to the replica holding its longest known prefix, unless that
replica's outstanding tokens exceed the least loaded one's by more than `max_imbalance_tokens`
(affinity must not pile a hot prefix onto one replica while another idles); otherwise, and for
prompts with no known prefix, to the least loaded healthy replica. Outstanding tokens are the
estimated prompt tokens plus `max_tokens` of the requests in flight.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Replica:
    url: str
    healthy: bool = True
    models: set[str] = field(default_factory=set)   # served model names (from /v1/models); empty: unknown
    outstanding_tokens: int = 0
    in_flight: int = 0
    num_requests: int = 0
    num_failures: int = 0
    last_error: str | None = None

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models


def estimate_tokens(text: str, max_tokens: int | None) -> int:
    return len(text) // 4 + 1 + (max_tokens or 16)


class PrefixAffinityPolicy:
    def __init__(self, replicas: list[Replica], chunk_chars: int = 64, max_chunks: int = 8,
                 max_imbalance_tokens: int = 4096, max_entries: int = 100_000) -> None:
        if not replicas:
            raise ValueError("the router needs at least one backend")
        self.replicas = replicas
        self.chunk_chars, self.max_chunks = chunk_chars, max_chunks
        self.max_imbalance_tokens = max_imbalance_tokens
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, Replica] = OrderedDict()   # prefix hash -> replica (LRU)

    def prefix_hashes(self, model: str | None, text: str) -> list[bytes]:
        """Hashes of the prompt's first 1..K whole chunks (none for a prompt shorter than one chunk)."""
        digest = hashlib.sha256((model or "").encode())
        hashes = []
        for k in range(min(len(text) // self.chunk_chars, self.max_chunks)):
            digest.update(text[k * self.chunk_chars:(k + 1) * self.chunk_chars].encode())
            hashes.append(digest.copy().digest())
        return hashes

    def choose(self, model: str | None, hashes: list[bytes], exclude: set[str] = frozenset()) -> Replica | None:
        candidates = [r for r in self.replicas if r.healthy and r.serves(model) and r.url not in exclude]
        if not candidates:
            return None
        # Ties (e.g. idle replicas) go to the one that served fewest requests, so load spreads.
        least = min(candidates, key=lambda r: (r.outstanding_tokens, r.in_flight, r.num_requests))
        for h in reversed(hashes):   # longest known prefix first
            owner = self._owner.get(h)
            if owner is not None and owner in candidates:
                if owner.outstanding_tokens <= least.outstanding_tokens + self.max_imbalance_tokens:
                    return owner
                break
        return least

    def record(self, replica: Replica, hashes: list[bytes]) -> None:
        """`replica` now caches these prefixes (the newest owner wins: it has the blocks freshest)."""
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget(self, replica: Replica) -> None:
        """A replica that died lost its cache."""
        for h in [h for h, r in self._owner.items() if r is replica]:
            del self._owner[h]
