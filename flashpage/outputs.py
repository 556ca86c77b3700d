"""What generate() returns, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS or a stop token), "length" (max_tokens or the context), None while running
    stop_reason: int | None = None  # the stop token id that ended it, if any


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
