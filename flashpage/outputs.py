"""What generate() returns, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability at one position, as vLLM's: its rank (1 = most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token or string), "length" (max_tokens or context), "abort", None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None for EOS)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token, when asked: the sampled token first,
    # then the top-k


@dataclass
class RequestMetrics:
    """When things happened to a request (time.time() seconds), as vLLM's RequestMetrics."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # first entry None, as in vLLM
    metrics: RequestMetrics | None = None


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt and generated tokens
    output_token_ids: list[int]
    text: str
    cum_logprob: float
    score: float  # cum_logprob / len(tokens) ** length_penalty (EOS not counted), as vLLM ranks beams
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
