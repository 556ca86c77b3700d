"""The step contract: the scheduler's plan for one forward pass (`StepPlan`) and what the runner gives back
(`StepResult`). Plain data, host-side lists only, so a plan can be broadcast to other ranks as it is.

One step computes, for each scheduled sequence, some tokens at explicit positions (a prompt chunk, a decode token,
or a token plus proposals to verify), writing their K/V into the sequence's blocks. The last `num_logits` of them
give logits; each `SampleSpec` draws one token from one logits row, so a sequence can get several tokens back
(speculative verification) and forked samples can share their parent's row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashpage.kv import CopyOp
from flashpage.sampling_params import SamplingParams


@dataclass
class SeqStep:
    """One sequence's share of a step."""
    seq_id: int
    token_ids: list[int]  # the tokens whose K/V this step computes
    positions: list[int]  # each token's position in its sequence (RoPE, cache slot)
    block_table: list[int]
    num_logits: int = 0  # the last num_logits tokens give logits rows (0: a prompt chunk that is not the last)
    last_token_from_row: int | None = None  # token_ids[-1] is the previous step's sampled token of this row
    prompt_logprobs: int | None = None  # top-k log-probs of each prompt token this step's tokens predict
    prompt_targets: list[int] = field(default_factory=list)  # those prompt tokens (token_ids[i] predicts [i])


@dataclass
class SampleRow:
    """How to draw one token: the sequence's parameters and what they look at."""
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far, where penalties look at them (else empty)
    num_output: int
    seed: int  # this draw's random stream
    blocked: list[int] = field(default_factory=list)  # tokens it may not pick yet (stop tokens before min_tokens)


@dataclass
class SampleSpec:
    seq_id: int  # the sequence the token is for
    logits_row: int  # which row of the step's logits (rows in SeqStep order, num_logits each)
    row: SampleRow


@dataclass
class StepPlan:
    seqs: list[SeqStep] = field(default_factory=list)
    samples: list[SampleSpec] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)  # block copies (copy-on-write) to do before the step

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.seqs)


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # under the model's raw distribution
    top: dict[int, float] | None = None  # top-k {token id: logprob}, best first, when the request asked for them


@dataclass
class StepResult:
    sampled: dict[int, list[SampledToken]] = field(default_factory=dict)  # seq_id -> its tokens, in order
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)  # seq_id -> one per target
