"""Structured outputs: a grammar (JSON schema, regex, choice, Lark/GBNF grammar) that every sampled token must keep.

llguidance (docs/structured-output.md says why this library) gives each constrained sequence a matcher. Each step
the host fills one bit per vocabulary token for every constrained sample row, while the device runs the forward
pass; the sampler applies the mask to the logits on the device, one launch for the batch. The token drawn is then
fed back to its matcher. With overlap, the next step is planned and its forward pass launched before that token is
on the host; the engine reads it back just before filling that step's masks. A speculative proposal is first cut
to its longest prefix the grammar accepts, and the rows that verify it get the masks of the states after each
proposed token.
"""

from __future__ import annotations

import functools
import itertools
import json
import os

import llguidance
import llguidance.torch
import torch

from flashpage.errors import ParameterError
from flashpage.sampling_params import StructuredOutputsParams
from flashpage.tokenizer import Tokenizer


class StructuredOutputs:
    """The engine's grammar side: compiles requests' constraints into matchers and fills a step's token masks."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._executor = None
        # One host buffer for the masks, pinned on CUDA so an upload does not wait for the device; reused, as a step's
        # masks are filled once the step before it is read back, when every earlier upload is done (allocating
        # pinned memory each step cost 0.2 ms).
        self._buffer = torch.empty(0, dtype=torch.int32)
        # Compiled matchers at their start, by constraint: many requests share a schema, and a copy of a compiled
        # matcher costs about 1 µs where compiling one costs about 1 ms.
        self._compiled = functools.lru_cache(maxsize=256)(self._compile)

    @functools.cached_property
    def _lltokenizer(self) -> llguidance.LLTokenizer:  # built on first use (about a second for a 128k vocabulary)
        return llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos)

    def matcher(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; ParameterError if the grammar does not compile."""
        if self._tokenizer is None:
            raise ParameterError("structured_outputs", "structured outputs need a tokenizer, and this model has none")
        text = json.dumps(so.json) if isinstance(so.json, dict) else \
            json.dumps(so.choice) if so.choice else so.json or so.regex or so.grammar
        return self._compiled(so.kind, text, so.disable_any_whitespace).deep_copy()

    def _compile(self, kind: str, text: str | None, compact: bool) -> llguidance.LLMatcher:
        try:
            if kind in ("json", "json_object"):
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    text if kind == "json" else '{"type": "object"}',
                    overrides={"whitespace_flexible": False} if compact else None)
            else:
                grammar = llguidance.grammar_from(kind, text)
        except (ValueError, TypeError) as e:
            raise ParameterError("structured_outputs", f"the {kind} constraint does not compile: {e}") from None
        matcher = llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ParameterError("structured_outputs", f"the {kind} constraint does not compile: {matcher.get_error()}")
        return matcher

    def bitmask(self, samples, matchers: dict[int, llguidance.LLMatcher],
                proposals: dict[int, list[int]]) -> torch.Tensor | None:
        """The token masks [len(samples), ceil(V / 32)] int32 (-1: free rows) of a step's samples: a constrained
        sequence's k-th row of the step is masked as its matcher after the first k tokens of its proposal."""
        constrained = []
        for seq_id, rows in itertools.groupby(range(len(samples)), key=lambda i: samples[i].seq_id):
            if seq_id in matchers:
                rows = list(rows)
                constrained.append((matchers[seq_id], rows[0], proposals.get(seq_id, [])[:len(rows) - 1]))
        if not constrained:
            return None
        if self._buffer.shape[0] < len(samples):
            self._buffer = llguidance.torch.allocate_token_bitmask(max(len(samples), 2 * self._buffer.shape[0]),
                                                                   self.vocab_size)
        mask = self._buffer[:len(samples)]
        mask.numpy().fill(-1)  # (numpy's fill stays on this thread: torch's would wake its thread pool)
        if self._executor is None:
            # A few threads: on a 16-core host, 4 filled 32 masks in 0.17 ms and the default 12 in 3.3 ms
            # (docs/structured-output.md)
            self._executor = llguidance.LLExecutor(max(1, min(4, (os.cpu_count() or 1) // 2)))
        plain = [(m, row) for m, row, draft in constrained if not draft]
        if plain:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, plain, mask)
        if len(plain) < len(constrained):  # (this one refuses an empty draft)
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, [c for c in constrained if c[2]], mask)
        return mask

