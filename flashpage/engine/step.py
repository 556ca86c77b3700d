"""The step contract: the scheduler's plan for one forward pass (`StepPlan`) and what the runner gives back
(`StepResult`). Plain data, host-side lists only, so a plan can be broadcast to other ranks as it is.

One step computes, for each scheduled sequence, some tokens at explicit positions (a prompt chunk, a decode token,
or a token plus proposals to verify), writing their K/V into the sequence's blocks. The last `num_logits` of them
give logits; each `SampleSpec` draws one token from one logits row, so a sequence can get several tokens back
(speculative verification) and forked samples can share their parent's row. `StepResult.sampled` has one
`SampledToken` per `SampleSpec`, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flashpage.kv import CopyOp
from flashpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class SeqStep:
    """One sequence's share of a step."""
    seq_id: int
    token_ids: list[int]  # the tokens whose K/V this step computes
    positions: list[int]  # each token's position in its sequence (RoPE, cache slot)
    block_table: list[int]
    num_logits: int = 0  # the last num_logits tokens give logits rows (0: a prompt chunk that is not the last)
    last_token_from_row: int | None = None  # token_ids[-1] is the previous step's sampled token of this row
    prompt_logprobs: int | None = None  # top-k log-probs of each prompt token this step's tokens predict
    prompt_targets: list[int] | None = None  # those prompt tokens (token_ids[prompt_skip + i] predicts [i])
    prompt_skip: int = 0  # the tokens before those that predict the first target (scored in an earlier step)
    # A token tree (its last token and a proposed tree): each token's parent among token_ids (-1: none). Its
    # tokens take consecutive cache slots from positions[0] on; positions are then by depth.
    tree: list[int] | None = None


@dataclass(slots=True)
class SampleRow:
    """How to draw one token: the sequence's parameters and what they look at."""
    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output so far, where penalties look at them (else empty)
    num_output: int
    seed: int  # this draw's random stream
    blocked: Sequence[int] = ()  # tokens it may not pick yet (stop tokens before min_tokens)


@dataclass(slots=True)
class SampleSpec:
    seq_id: int  # the sequence the token is for
    logits_row: int  # which row of the step's logits (rows in SeqStep order, num_logits each)
    row: SampleRow
    # A draft model's proposed tokens to verify here: one (a chain), or a tree node's children in the order they were
    # drawn without replacement (engine/spec/multi_branch.py); and the row of the draft's probabilities they were
    # drawn from (the draft's tensor, which the proposer hands to the runner with the plan)
    draft_tokens: tuple[int, ...] = ()
    draft_row: int = -1


@dataclass(slots=True)
class StepPlan:
    seqs: list[SeqStep] = field(default_factory=list)
    samples: list[SampleSpec] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)  # block copies (copy-on-write) to do before the step
    moves: list[tuple[int, int]] = field(default_factory=list)  # (from, to) cache slots to copy before those: a
    # verified tree's kept tokens into their places
    num_logits: int = 0  # logits rows of all seqs

    def add(self, step: SeqStep) -> int:
        """Append a sequence's share; returns the index of its first logits row."""
        self.seqs.append(step)
        self.num_logits += step.num_logits
        return self.num_logits - step.num_logits


@dataclass(slots=True)
class SampledToken:
    """A token and its log-probability (a sampled token, or a prompt token's where prompt log-probs are asked)."""
    seq_id: int
    token_id: int
    logprob: float  # under the model's raw distribution
    rank: int | None = None  # 1 = the most likely token; where log-probs were asked for
    top: dict[int, float] | None = None  # top-k {token id: logprob}, best first, where asked for


@dataclass(slots=True)
class StepResult:
    sampled: list[SampledToken] = field(default_factory=list)  # in plan order: a sequence's tokens in turn
    prompt_logprobs: dict[int, list[SampledToken]] = field(default_factory=dict)  # seq_id -> one per target
    # Where the runner keeps it (else None): the last layer's residual stream at every token the step computed, in
    # plan order, on the device; and each sample's row of it
    hidden: torch.Tensor | None = None
    sample_rows: list[int] = field(default_factory=list)
    # On the device, a row per sample: the logits each token was drawn from, after masks and penalties (a CUDA
    # graph's rows are overwritten by the runner's next step: read them before it)
    logits: torch.Tensor | None = None
