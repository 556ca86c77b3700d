"""Sequence: one token stream being generated (a request with n > 1 has n of them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashpage.engine.step import SampleRow
from flashpage.sampling_params import SamplingParams
from flashpage.tokenizer import IncrementalDetokenizer

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
PENDING = -1  # a token the GPU is still sampling: the next step may compute on it (read on the device) meanwhile


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of its request's n samples
    token_ids: list[int]  # prompt + generated so far; the last num_pending are PENDING
    num_prompt_tokens: int
    params: SamplingParams
    seed: int  # the request's seed, or one drawn for it: each draw's stream derives from it
    stop_ids: list[int]  # tokens that end it (EOS unless ignore_eos, stop_token_ids): blocked before min_tokens
    bad_words: list[list[int]] = field(default_factory=list)  # params.bad_words as token ids
    detokenizer: IncrementalDetokenizer | None = None
    forks: list[Sequence] = field(default_factory=list)  # samples 2..n, forked off once the prompt is computed
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: str = WAITING
    text: str = ""  # generated text (stop strings cut off)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict] | None = None  # per generated token {token id: Logprob}
    prompt_logprobs: list[dict | None] | None = None
    prompt_logprobs_asked: int = 1  # the prompt positions before this one have had their log-probs asked for
    num_pending: int = 0  # PENDING tokens at the end of token_ids
    pending_row: int | None = None  # the last step's sample row of its PENDING token
    last_pending: bool = False  # its pending token ends it (length limit): schedule nothing more
    first_scheduled_time: float | None = None  # time.time() of its first admission
    proposal: list[int] = field(default_factory=list)  # speculative tokens proposed for its next step
    proposal_rows: list[int] | None = None  # their rows of the draft model's probabilities (None: prompt lookup)
    proposal_parents: list[int] | None = None  # a token tree's: each proposed token's parent (-1: the last token)
    verifying: list[int] = field(default_factory=list)  # the proposal its step in flight verifies
    verifying_parents: list[int] | None = None  # and its tree
    grammar: object | None = None  # its structured-output matcher (llguidance.LLMatcher): fed every token it keeps

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens known so far (pending ones left out)."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending]

    @property
    def num_known(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def ends_at(self, num_tokens: int, max_model_len: int) -> bool:
        """Whether the sequence is done once it holds `num_tokens` tokens: max_tokens generated, or the context full."""
        return (self.params.max_tokens is not None and num_tokens - self.num_prompt_tokens >= self.params.max_tokens) \
            or num_tokens >= max_model_len

    def sample_row(self, proposed: list[int] = ()) -> SampleRow:
        """How to draw this sequence's next token, or the one after `proposed` tokens (speculation). The stream
        depends only on the seed, the sample index and the position, so a seeded request gives the same tokens
        whatever else is batched with it, and whether or not they were proposed."""
        tokens = self.token_ids + list(proposed) if proposed else self.token_ids
        num_output = len(tokens) - self.num_prompt_tokens
        blocked = self.stop_ids if num_output < self.params.min_tokens else ()
        if self.bad_words:  # a bad word's last token, where the output ends with the tokens before it
            ends = [w[-1] for w in self.bad_words if len(w) - 1 <= num_output
                    and tokens[len(tokens) - len(w) + 1:] == w[:-1]]
            blocked = [*blocked, *ends]
        history = list(tokens) if self.params.uses_penalties else ()  # only penalties read it
        return SampleRow(self.params, history, num_output, hash((self.seed, self.index, len(tokens))) % 2**63, blocked)

    def room(self, max_model_len: int) -> int:
        """Tokens it may still grow by before it ends (max_tokens or the context)."""
        limit = max_model_len if self.params.max_tokens is None else \
            min(max_model_len, self.num_prompt_tokens + self.params.max_tokens)
        return limit - len(self.token_ids)
