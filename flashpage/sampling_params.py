"""SamplingParams and BeamSearchParams: how to pick tokens and when to stop (vLLM's names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from flashpage.errors import ParameterError


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language: set exactly one of these (vLLM's names)."""
    json: str | dict | None = None  # a JSON schema (as a dict or its text)
    regex: str | None = None  # a regular expression (Rust regex syntax) the whole output matches
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # a context-free grammar, in Lark or GBNF (llama.cpp) syntax
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens (default: any whitespace)

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self):
        kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ParameterError("structured_outputs", "structured outputs take exactly one of json, regex, choice, "
                                 f"grammar or json_object, got {', '.join(kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ParameterError("structured_outputs", "structured_outputs.json must be a JSON schema (a dict or a string)")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not (isinstance(getattr(self, name), str) and getattr(self, name)):
                raise ParameterError("structured_outputs", f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ParameterError("structured_outputs", "structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True):
            raise ParameterError("structured_outputs", "structured_outputs.json_object must be true")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ParameterError("structured_outputs", "structured_outputs.disable_any_whitespace must be true or false")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or output
    presence_penalty: float = 0.0  # subtracted once from tokens present in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    seed: int | None = None  # per request: the same seed gives the same tokens, whatever else runs
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: str | list[str] | None = None  # strings that end generation; not in the output text unless asked
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) in the text
    logprobs: int | None = None  # top-k log-probabilities per generated token (plus the sampled one); -1: all
    prompt_logprobs: int | None = None  # likewise for each prompt token after the first
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, text stays empty
    bad_words: list[str] = field(default_factory=list)  # words never generated (their last token is banned
    # wherever the tokens before it were just generated)
    allowed_token_ids: list[int] | None = None  # sample only among these
    logit_bias: dict[int, float] | None = None  # added to the logits of these tokens, in [-100, 100]
    structured_outputs: StructuredOutputsParams | dict | None = None  # a JSON schema, regex, choice or grammar
    guided_decoding: StructuredOutputsParams | dict | None = None  # vLLM's older name for structured_outputs

    def __post_init__(self):
        def bad(name, why):
            raise ParameterError(name, f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            bad("stop", "must be a non-empty string or a list of them")
        self.stop = list(self.stop or [])
        if not isinstance(self.stop_token_ids, (list, tuple)):
            bad("stop_token_ids", "must be a list of non-negative token ids")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_real(x):  # inf and nan are refused everywhere (temperature=inf would sample uniformly)
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not is_real(self.temperature) or not self.temperature >= 0:
            bad("temperature", "must be a finite number >= 0")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (0 or -1 disable it)")
        if not is_real(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not is_real(self.repetition_penalty) or not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_real(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):  # the engine's max_logprobs bounds them
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < -1):
                bad(name, "must be an integer >= 0, -1 (the whole vocabulary) or None")
        for name in ("include_stop_str_in_output", "detokenize", "skip_special_tokens", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if self.stop and not self.detokenize:
            bad("stop", "needs detokenize=True (stop strings are found in the text)")
        if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", "must be a list of non-empty strings")
        self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, (list, tuple))
                                                   or not self.allowed_token_ids
                                                   or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a map of token id to bias")
            try:  # JSON keys are strings
                bias = {int(t): b for t, b in self.logit_bias.items()}
            except (TypeError, ValueError):
                bad("logit_bias", "must map token ids (integers) to biases")
            if not all(t >= 0 and is_real(b) and -100 <= b <= 100 for t, b in bias.items()):
                bad("logit_bias", "must map token ids to finite biases in [-100, 100]")
            self.logit_bias = bias
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                bad("guided_decoding", "is the older name of structured_outputs: set one of them")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {f.name for f in fields(StructuredOutputsParams)}
            if unknown:
                bad("structured_outputs", f"has unknown keys {sorted(unknown)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams or a dict of its fields")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def needs_history(self) -> bool:
        """Sampling reads the tokens generated so far on the host (so no step may run ahead of them)."""
        return self.uses_penalties or bool(self.bad_words)

    @property
    def changes_logits(self) -> bool:
        return self.uses_penalties or self.allowed_token_ids is not None or bool(self.logit_bias) \
            or self.structured_outputs is not None


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0  # score = cumulative logprob / length ** length_penalty
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
