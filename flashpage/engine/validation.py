"""RequestValidator: whether a request can ever run on an engine, from the engine's limits alone.

Kept apart from the engine so that a process without the model (the server's, when the engine steps in a process
of its own) answers bad input with a 400 before anything is sent to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpage.engine.structured import StructuredOutputs
from flashpage.errors import ParameterError
from flashpage.sampling_params import SamplingParams
from flashpage.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int  # -1: no limit
    block_size: int
    num_blocks: int  # KV blocks in the cache
    eos_token_ids: tuple[int, ...]


class RequestValidator:
    def __init__(self, limits: EngineLimits, tokenizer: Tokenizer | None, structured: StructuredOutputs | None = None):
        self.limits, self.tokenizer = limits, tokenizer
        self.structured = structured or StructuredOutputs(tokenizer, limits.vocab_size, list(limits.eos_token_ids))

    def __call__(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (a ParameterError naming the field) if the request can never run."""
        lim = self.limits
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise ParameterError("prompt", "prompt is empty")
        vocab = lim.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
            raise ParameterError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        n, limit = len(prompt_token_ids), lim.max_model_len
        if n >= limit:
            raise ParameterError("prompt", f"prompt has {n} tokens, which leaves no room to generate within the "
                                 f"model's context (max_model_len={limit})")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ParameterError("max_tokens", f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is "
                                 f"{n + params.max_tokens} tokens, over the model's context (max_model_len={limit}); "
                                 f"lower max_tokens or shorten the prompt")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            k = vocab if k == -1 else k
            if k is not None and lim.max_logprobs != -1 and k > lim.max_logprobs:
                raise ParameterError(name, f"{name}={getattr(params, name)} asks for {k} log-probs per token, over "
                                     f"max_logprobs={lim.max_logprobs} (an engine setting)")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", params.logit_bias)):
            if ids and not all(t < vocab for t in ids):
                raise ParameterError(name, f"{name} holds token ids outside the vocabulary [0, {vocab})")
        if params.bad_words and self.tokenizer is None:
            raise ParameterError("bad_words", "bad_words need a tokenizer, and this model has none")
        if params.structured_outputs is not None:
            self.structured.matcher(params.structured_outputs)  # compiles it (once), or names what is wrong
        longest = limit if params.max_tokens is None else n + params.max_tokens
        need = -(-longest // lim.block_size)
        if need > lim.num_blocks:
            raise ParameterError("max_tokens", f"request needs up to {need} KV blocks ({longest} tokens) but the "
                                 f"cache has {lim.num_blocks}; lower max_tokens or enlarge the cache")
