"""LLM: the offline Python API (vLLM's names): generate() and chat() over a loaded model."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from flashpage.engine.runner import ModelRunner
from flashpage.loader import load_model
from flashpage.loader.default_model import DEFAULT_MODEL
from flashpage.outputs import CompletionOutput, RequestOutput
from flashpage.sampling_params import SamplingParams
from flashpage.tokenizer import IncrementalDetokenizer

PromptType = str | dict | list[int]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, dtype="auto", device: str = "auto", seed: int = 0,
                 load_format: str = "auto", max_model_len: int | None = None, attention_backend: str = "auto"):
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if attention_backend == "auto":  # Triton kernels on the GPU; on CPU the interpreter would be far too slow
            attention_backend = "triton" if str(device).startswith("cuda") else "torch"
        loaded = load_model(model, load_format=load_format, dtype=dtype, device=device, seed=seed)
        self.model_name = model
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        limit = loaded.config.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}] for this model, got {max_model_len}")
        self.max_model_len = max_model_len or limit
        self.runner = ModelRunner(loaded, self.max_model_len, attention_backend)
        self._generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    # ----- public API ---------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt (text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}); outputs keep input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        requests = [self._tokenize(p) for p in prompts]  # validate every prompt before doing any work
        params = self._params_list(sampling_params, len(requests))
        bar = tqdm(total=len(requests), desc="Generating", disable=not use_tqdm or len(requests) < 2)
        outputs = []
        for (text, ids), sp in zip(requests, params):
            outputs.append(self._run(text, ids, sp))
            bar.update(1)
        bar.close()
        return outputs

    def chat(self, messages: list[dict] | Sequence[list[dict]], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or several, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.chat_prompt_ids(c, add_generation_prompt)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        tok = self._require_tokenizer()
        # The rendered template already holds any BOS it wants, so no special tokens are added (as transformers).
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces as they are generated, for one prompt."""
        _, ids = self._tokenize(prompt)
        detok = IncrementalDetokenizer(self._require_tokenizer(), ids)
        for token, _ in self._tokens(ids, sampling_params or SamplingParams()):
            yield detok.step(token)

    # ----- internals ----------------------------------------------------------------------------
    def _run(self, text, ids, sp: SamplingParams) -> RequestOutput:
        tokens, finish, stop_reason = [], "length", None
        for token, reason in self._tokens(ids, sp):
            tokens.append(token)
            finish, stop_reason = reason or finish, token if reason else None
        out_text = self.tokenizer.decode(tokens) if self.tokenizer else ""
        completion = CompletionOutput(0, out_text, tokens, finish, stop_reason if finish == "stop" else None)
        return RequestOutput(str(next(self._request_ids)), text, ids, [completion])

    def _tokens(self, ids: list[int], sp: SamplingParams) -> Iterator[tuple[int, str | None]]:
        """(token, finish reason or None) until a stop condition; the last pair carries "stop" when one hit."""
        gen = self._generator if sp.seed is None else torch.Generator(device=self.runner.device).manual_seed(sp.seed)
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.config.eos_token_ids))
        for count, token in enumerate(self.runner.stream(ids, sp, gen), start=1):
            hit = token in stops and count > sp.min_tokens
            yield token, "stop" if hit else None
            if hit or count == sp.max_tokens:
                return

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, list):
            text, ids = None, prompt
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError("prompt text must be a string")
            ids = self._require_tokenizer().encode(text)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, which leaves no room to generate within the model's context "
                f"(max_model_len={self.max_model_len})"
            )
        return text, ids

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer; pass prompts as token ids")
        return self.tokenizer

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts")
        return list(sampling_params)
