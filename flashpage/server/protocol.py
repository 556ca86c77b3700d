"""OpenAI request bodies (pydantic) and their mapping to SamplingParams, with vLLM's extra fields."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flashpage.errors import ParameterError
from flashpage.sampling_params import SamplingParams


# OpenAI and vLLM request fields flashpage does not serve: a request that sets one gets a 400 naming it, instead of
# an answer that silently ignores it. Other unknown fields (user, metadata, ...) change nothing and are ignored.
UNSERVED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "suffix", "best_of",
            "use_beam_search", "audio", "modalities", "prediction", "lora_request", "priority", "chat_template",
            "documents", "echo", "logits_processors", "return_tokens_as_token_ids", "prompt_embeds",
            "guided_whitespace_pattern")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk, not only a final one


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: see UNSERVED

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep the prompt's last k tokens
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unserved(self) -> list[str]:
        """UNSERVED fields the request sets (to a value other than an empty one)."""
        return [k for k in UNSERVED if (self.model_extra or {}).get(k) not in (None, [], {}, 1 if k == "best_of" else None)]

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError (naming the field) for values out of range."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, bad_words=self.bad_words or [],
            allowed_token_ids=self.allowed_token_ids, logit_bias=self.logit_bias,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            structured_outputs=self._structured_outputs(),
        )

    def _structured_outputs(self) -> dict | None:
        """The one structured-output field the request sets, as StructuredOutputsParams' fields."""
        given = {name: value for name, value in (
            ("response_format", self._response_format()), ("structured_outputs", self.structured_outputs),
            ("guided_json", self.guided_json and {"json": self.guided_json}),
            ("guided_regex", self.guided_regex and {"regex": self.guided_regex}),
            ("guided_choice", self.guided_choice and {"choice": self.guided_choice}),
            ("guided_grammar", self.guided_grammar and {"grammar": self.guided_grammar})) if value}
        if len(given) > 1:
            raise ParameterError(next(iter(given)), f"set one structured-output field, not {', '.join(given)}")
        return next(iter(given.values()), None)

    def _response_format(self) -> dict | None:
        """OpenAI's response_format as a structured-output constraint."""
        fmt = self.response_format
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"json_object": True}
        if fmt.get("type") == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ParameterError("response_format", "response_format json_schema needs json_schema.schema, a JSON "
                                     "schema object")
            return {"json": schema}
        raise ParameterError("response_format", f"response_format type {fmt.get('type')!r} is not supported (text, "
                             "json_object, json_schema)")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: the prompt's log-probs, nothing generated
    logprobs: int | None = None
    echo: bool = False  # the prompt (and, with logprobs, its log-probs) before the completion
    add_special_tokens: bool = True  # the tokenizer's BOS before a text prompt, where the model has one (vLLM's)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the answer continues the final message (vLLM's)
    add_special_tokens: bool = False  # a BOS before the rendered template, which holds any it wants (vLLM's)
    chat_template_kwargs: dict | None = None  # more variables for the chat template (vLLM's)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion's `prompt`, or a chat's `messages` rendered by the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (as their endpoints)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str, code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
