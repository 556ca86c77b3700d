"""LLM: the offline Python API (vLLM's names): generate(), chat(), beam_search(), stream(), stats(); and
skeleton_of_thought()."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from flashpage.engine.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine, streamable_end
from flashpage.engine.skeleton import skeleton_of_thought
from flashpage.errors import ParameterError
from flashpage.loader.default_model import DEFAULT_MODEL
from flashpage.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from flashpage.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | dict | list[int]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **settings):
        """`settings`: any EngineConfig field (flashpage/engine/config.py lists them with their defaults)."""
        self.engine = LLMEngine(EngineConfig.from_settings(model=model, **settings))
        self.model_name = model
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def stats(self) -> dict:
        """KV cache and scheduler counters (see README)."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks now (otherwise at exit); this LLM cannot generate afterwards."""
        self.engine.shutdown()

    # ----- public API ---------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt (text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}); outputs keep input order."""
        prompts = _as_prompt_list(prompts)
        requests = [_at(i, self._tokenize, p) for i, p in enumerate(prompts)]
        params = self._params_list(sampling_params, len(requests))
        for i, ((_, ids), sp) in enumerate(zip(requests, params)):  # validate everything before anything runs
            _at(i, self.engine.validate, ids, sp)
        ids_in_order = []
        for (text, ids), sp in zip(requests, params):
            request_id = str(next(self._request_ids))
            self.engine.add_request(request_id, ids, sp, prompt=text)
            ids_in_order.append(request_id)
        return self._run(ids_in_order, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or several, then generate.
        `continue_final_message` (with add_generation_prompt=False) continues the final message instead of
        answering it; `chat_template_kwargs` are more variables for the template (`Tokenizer.apply_chat_template`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self._require_tokenizer()
        texts = [tok.apply_chat_template(c, add_generation_prompt, continue_final_message, chat_template_kwargs)
                 for c in conversations]
        # The rendered template already holds any BOS it wants, so no special tokens are added (as transformers).
        prompts = [{"prompt": t, "prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def skeleton_of_thought(self, question: str, sampling_params: SamplingParams | None = None, *,
                            max_points: int = 10, skeleton_max_tokens: int = 200, use_tqdm: bool = False):
        """Skeleton-of-thought: a skeleton of short numbered points first, then every point expanded in one batch
        sharing the question's and skeleton's blocks (`flashpage.engine.skeleton`)."""
        return skeleton_of_thought(self, question, sampling_params, max_points=max_points,
                                   skeleton_max_tokens=skeleton_max_tokens, use_tqdm=use_tqdm)

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[int]:
        tok = self._require_tokenizer()
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                                  chat_template_kwargs), add_special_tokens=False)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search, as vLLM's LLM.beam_search: each step extends every live beam by one token.

        All beams of all prompts run as one batch per step; their common prefix blocks are shared through the
        prefix cache, so each step recomputes at most the last partial block of each beam.
        """
        prompts = _as_prompt_list(prompts)
        width = params.beam_width
        step_params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
        tokenized = [self._tokenize(p)[1] for p in prompts]
        for ids in tokenized:
            self.engine.validate(ids, SamplingParams(max_tokens=params.max_tokens))
        live = [[(ids, 0.0)] for ids in tokenized]  # per prompt: (tokens, cumulative logprob)
        done: list[list[tuple[list[int], float, str]]] = [[] for _ in tokenized]
        eos = set(self.config.eos_token_ids)
        for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
            flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
            if not flat:
                break
            outs = self.generate([{"prompt_token_ids": tokens} for _, (tokens, _) in flat], step_params, use_tqdm=False)
            candidates: list[list[tuple[list[int], float]]] = [[] for _ in tokenized]
            for (i, (tokens, cum)), out in zip(flat, outs):
                for token, lp in out.outputs[0].logprobs[0].items():
                    candidates[i].append((tokens + [token], cum + lp.logprob))
            for i, cands in enumerate(candidates):
                cands.sort(key=lambda c: c[1], reverse=True)
                live[i] = []
                for tokens, cum in cands[:2 * width]:
                    if len(live[i]) == width:
                        break
                    if tokens[-1] in eos and not params.ignore_eos:
                        done[i].append((tokens, cum, "stop"))
                    else:
                        live[i].append((tokens, cum))
        results = []
        for i, ids in enumerate(tokenized):
            finals = done[i] + [(t, c, "length") for t, c in live[i]]
            seqs = []
            for tokens, cum, reason in finals:
                length = len(tokens) - (reason == "stop")
                out_ids = tokens[len(ids):]
                text = self.tokenizer.decode(out_ids) if self.tokenizer else ""
                seqs.append(BeamSearchSequence(tokens, out_ids, text, cum, cum / length**params.length_penalty, reason))
            seqs.sort(key=lambda s: s.score, reverse=True)
            results.append(BeamSearchOutput(seqs[:width]))
        return results

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces of one completion as they are generated (stop strings never shown)."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream() takes one sample (n=1)")
        text, ids = self._tokenize(prompt)
        self._require_tokenizer()
        request_id = str(next(self._request_ids))
        self.engine.add_request(request_id, ids, params, prompt=text)
        sent = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    text_so_far = out.outputs[0].text
                    end = streamable_end(text_so_far, params.stop, out.finished)
                    if end > sent:
                        yield text_so_far[sent:end]
                        sent = end
                    if out.finished:
                        return
        finally:
            self.engine.abort_request(request_id)  # no-op once finished; frees blocks if the caller stopped early

    # ----- internals ----------------------------------------------------------------------------
    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm or len(request_ids) < 2)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(final_only=True):
                    done[out.request_id] = out
                    bar.update(1)
        finally:
            bar.close()
            for request_id in request_ids:  # an exception mid-run must not leave requests holding blocks
                if request_id not in done:
                    self.engine.abort_request(request_id)
        return [done[r] for r in request_ids]

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


def _as_prompt_list(prompts) -> list:
    """One prompt (text, token ids or a dict) or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ParameterError("prompts", "prompts must be a string, a list of token ids, a dict, or a list of them; "
                             f"got {type(prompts).__name__}")
    return list(prompts)


def _at(index: int, check, *args):
    """Run a per-prompt check; its error names the prompt's index in the batch."""
    try:
        return check(*args)
    except ValueError as e:
        raise ParameterError(getattr(e, "param", "prompt"), f"prompt {index}: {e}") from None
