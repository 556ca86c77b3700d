"""Sequence: one token stream being generated (a request with n > 1 has n of them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashpage.sampling_params import SamplingParams
from flashpage.tokenizer import IncrementalDetokenizer

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of its request's n samples
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # admission order; preemption takes the newest
    generator: torch.Generator | None = None  # own random stream when the request is seeded
    detokenizer: IncrementalDetokenizer | None = None
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: str = WAITING
    text: str = ""  # generated text (stop strings cut off)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    output_counts: dict[int, int] = field(default_factory=dict)  # for presence / frequency penalties

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status == FINISHED
