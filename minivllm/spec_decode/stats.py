"""The speculation counters the engine reports (plain data: the server's process reads them without torch)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counters as vLLM names them (minivllm:spec_decode_*)."""
    num_drafts: int = 0            # verifications (one per speculating sequence per step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
