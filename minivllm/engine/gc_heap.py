"""Python's full garbage collections kept off the heap that exists before generation starts.

A full (generation-2) collection walks every tracked object of the process: with torch, transformers
and an engine loaded, that took 210-340 ms on the H100 machine's host, and one fell into most timed runs
of 256 x 512 -> 256 (`bench/spec_decode.py --parts load --trace`: every run with speculation on, one of three
without), while the device idled. `gc.freeze()` moves every object that
exists now into a permanent generation that collections skip, so a full collection during generation walks
only what generation allocates; `gc.unfreeze()` hands them back when the last user leaves, so an engine
dropped later (even in a reference cycle) is still collected. Both are constant-time list moves.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_users = 0


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap while the block runs (nested and concurrent users share one freeze)."""
    global _users
    with _lock:
        if _users == 0:
            gc.freeze()
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                gc.unfreeze()
