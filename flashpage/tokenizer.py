"""Tokenizer: a `tokenizers.Tokenizer` plus the bits around it (special ids, chat template, streaming decode).

Built from a Hugging Face `tokenizer.json` or from a GGUF file's `tokenizer.ggml.*` metadata.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

# llama.cpp's pre-tokenizer names -> the split regex their merges were learned with.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: list[int],
                 add_bos: bool, chat_template: str | None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template

    # ----- construction -------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise ValueError(f"{path} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        tcfg = _read_json(path / "tokenizer_config.json")
        template = tcfg.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        bos = _token_id(backend, tcfg.get("bos_token"))
        eos = _token_id(backend, tcfg.get("eos_token"))
        gen = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids = ([] if eos is None else [eos]) + ([gen] if isinstance(gen, int) else list(gen or []))
        # tokenizer.json's post-processor usually adds BOS itself; add_bos only covers configs that say so explicitly.
        add_bos = bool(tcfg.get("add_bos_token", False)) and not _post_processor_adds(backend, bos)
        return cls(backend, bos_token_id=bos, eos_token_ids=list(dict.fromkeys(eos_ids)), add_bos=add_bos,
                   chat_template=template)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, meta["tokenizer.ggml.merges"], meta.get("tokenizer.ggml.pre"))
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, meta["tokenizer.ggml.scores"], types)
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
        backend.add_special_tokens(special)
        backend.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        return cls(backend, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=list(dict.fromkeys(eos)),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
                   chat_template=meta.get("tokenizer.chat_template"))

    # ----- use ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> str:
        """The conversation as the model's chat template renders it. `continue_final_message` (vLLM's, and
        transformers'): the text ends inside the final message, without what closes it, so the model continues
        that message (a prefilled start of the answer). `chat_template_kwargs`: more variables for the template
        (say, `enable_thinking`)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content', got {m!r}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set: the first continues "
                             "the final message, the second starts a new one")
        extra = dict(chat_template_kwargs or {})
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & extra.keys()
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {sorted(reserved)}: they have parameters of their own")
        text = _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            **extra,
        )
        if not continue_final_message:
            return text
        final = messages[-1]["content"] if messages else None
        if not isinstance(final, str) or not final.strip():
            raise ValueError("continue_final_message needs a final message with text to continue")
        # as transformers: cut after the final message's last occurrence (stripped, for templates that strip it)
        for content in (final, final.strip()):
            at = text.rfind(content)
            if at >= 0:
                return text[:at + len(content)]
        raise ValueError("continue_final_message: the chat template does not render the final message as given")

    def id_to_token(self, token_id: int) -> str:
        """The token as the vocabulary spells it (byte-level BPE's "Ġthe" for " the"), as transformers'
        convert_ids_to_tokens."""
        return self.backend.id_to_token(token_id) or ""

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.id_to_token(token_id)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a multi-byte character.

    Decodes a short window of the tail (vLLM's prefix/read offsets) so the cost per token stays constant,
    and holds text back while it ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])  # a little context so leading spaces decode as they will in full
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip_special_tokens = skip_special_tokens

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


# ----- helpers ------------------------------------------------------------------------------------
def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], ignore_merges=pre in _SPLITS))
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre == "smollm":  # SmolLM's tokenizer.json (and llama.cpp) split every digit on its own
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int]) -> HFTokenizer:
    """SentencePiece BPE (Llama 2, Mistral v0.1): merges ranked by the score of the piece they make."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores))
    merges = []
    for piece, s in score.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((s, vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    unk = next((t for t, ty in zip(tokens, types) if ty == 2), None)  # 2 is UNKNOWN
    tok = HFTokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_id(backend: HFTokenizer, token) -> int | None:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def _post_processor_adds(backend: HFTokenizer, bos: int | None) -> bool:
    return bos is not None and backend.encode("a").ids[:1] == [bos]


def _compile_template(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise ValueError(f"chat template error: {message}")

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(source)
