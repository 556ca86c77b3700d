"""Sequence: one token stream being generated (a request with n > 1 has n of them)."""

from __future__ import annotations

from dataclasses import dataclass

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
    detokenizer: IncrementalDetokenizer | None = None
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: str = WAITING
    text: str = ""  # generated text (stop strings cut off)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_pending: int = 0  # PENDING tokens at the end of token_ids
    last_pending: bool = False  # its pending token ends it (length limit): schedule nothing more

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens known so far (pending ones left out)."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status == FINISHED
