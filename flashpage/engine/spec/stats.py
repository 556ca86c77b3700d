"""Acceptance counters, vLLM's: drafts verified, tokens proposed, tokens accepted (overall and per position)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    k: int  # num_speculative_tokens
    num_drafts: int = 0  # verifications (a sequence's proposal in one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted

    def __post_init__(self):
        self.accepted_per_position = [0] * self.k

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict:
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_position": list(self.accepted_per_position),
            # accepted / proposed; tokens per verification (the accepted ones plus the one drawn after them)
            "spec_acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
            "spec_mean_accepted_length": 1 + self.num_accepted_tokens / max(1, self.num_drafts),
        }
