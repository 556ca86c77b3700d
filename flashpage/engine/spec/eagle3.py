"""EAGLE-3 (Li et al., 2025): the draft reads three of the target's layers instead of its last, and predicts
tokens directly, with its own LM head over a vocabulary of its own (a subset of the target's).

The target's feature at a token is its residual stream at the input of three layers (by default 2, L // 2 and
L - 3 of L, as EAGLE-3's training code and vLLM take them), concatenated; the draft's `fc` fuses it to one hidden
vector. The draft's decoder layer reads [norm(embedding of the next token); norm(feature)] (2 x hidden wide) into
its attention, keeps the feature as the residual, and its output before the final norm is fed back as the next
feature when it drafts past the known tokens (there without `fc`: it is already one hidden vector). Its LM head's
logits over the draft vocabulary land on the target's ids through `d2t` (target id = draft id + d2t[draft id]);
tokens outside the draft vocabulary are never proposed. Proposing, trees and rollback are EAGLE's
(`engine/spec/eagle.py`), lossless as there.

Checkpoint layout (as published, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; vLLM and SGLang read the same): a
directory with a LlamaConfig config.json (`draft_vocab_size`; optionally `target_hidden_size`, and
`eagle_config.eagle_aux_hidden_state_layer_ids`, the three layers) and in model.safetensors or pytorch_model.bin:
`fc.weight` [hidden, 3 x target hidden]; `midlayer.*`, one Llama decoder layer whose q/k/v projections are
[*, 2 x hidden] wide, plus `midlayer.hidden_norm.weight`; `norm.weight`; `lm_head.weight` [draft vocab, hidden];
`d2t` [draft vocab] (int64 offsets) and `t2d` [vocab] (not needed here); `embed_tokens.weight` where the draft
has its own (else the target's is used).
"""

from __future__ import annotations

import torch
from torch import nn

from flashpage.config import ModelConfig
from flashpage.engine.spec.checkpoint import read_config, read_tensors
from flashpage.engine.spec.eagle import EagleDraft, _bad, draft_config, draft_dir, filled_draft
from flashpage.model.llama import MergedLinear, RMSNorm
from flashpage.model.rope import rope_cos_sin


def feature_layers(model: str, num_layers: int) -> tuple[int, ...]:
    """The target layers whose input residual streams the draft fuses: its config's, or EAGLE-3's default."""
    eagle = read_config(draft_dir(model), _bad).get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or (2, num_layers // 2, num_layers - 3)
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in ids) or list(ids) != sorted(set(ids)):
        raise _bad(f"eagle_aux_hidden_state_layer_ids must be ascending layers of the target's {num_layers}, got "
                   f"{list(ids)}")
    return tuple(ids)


class Eagle3Draft(EagleDraft):
    def __init__(self, cfg: ModelConfig, num_features: int, draft_vocab: int, vocab: int, own_embedding: bool,
                 norm_before_residual: bool):
        super().__init__(cfg, fc_bias=False, input_norm=True)
        h = cfg.hidden_size
        self.fc = nn.Linear(num_features * h, h, bias=False)
        attn = self.layer.self_attn
        attn.qkv_proj = MergedLinear(2 * h, attn.qkv_proj.shards, bias=cfg.qkv_bias)  # [embedding; feature]
        self.layer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.embed_tokens = nn.Embedding(vocab, h) if own_embedding else None
        self.register_buffer("target_ids", torch.arange(draft_vocab))  # draft id -> target id
        self.vocab, self.norm_before_residual = vocab, norm_before_residual

    def fuse(self, ops, target, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's feature of the target's three streams [T, 3 x hidden]: one hidden vector through `fc`."""
        return ops.linear(hidden, self.fc.weight)

    def embed(self, target, ids: torch.Tensor) -> torch.Tensor:
        return (target.embed_tokens if self.embed_tokens is None else self.embed_tokens)(ids)

    def forward(self, ops, embedded: torch.Tensor, features: torch.Tensor, meta, kv_cache) -> torch.Tensor:
        """The next features [T, hidden] (the layer's output before the final norm) of elements (embedded tokens,
        features) at meta.positions."""
        if self._inv_freq.device != embedded.device:
            self._inv_freq = self._inv_freq.to(embedded.device)
        layer, features = self.layer, features.to(embedded.dtype)
        cos, sin = rope_cos_sin(self._inv_freq, meta.positions, embedded.dtype)
        normed = ops.rms_norm(features, layer.hidden_norm.weight, layer.hidden_norm.eps)
        x = torch.cat([ops.rms_norm(embedded, layer.input_layernorm.weight, layer.input_layernorm.eps), normed], -1)
        h = layer.self_attn(ops, x, None, cos, sin, meta, kv_cache,
                            residual=normed if self.norm_before_residual else features)
        return layer.mlp(ops, h, layer.post_attention_layernorm)

    def logprobs(self, ops, target, features: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the target's vocabulary: the draft's own head over its vocabulary, placed at the
        target's ids of its tokens (every other token -inf: never proposed)."""
        draft = torch.log_softmax(ops.linear(features, self.lm_head.weight, norm_weight=self.norm.weight,
                                             eps=self.norm.eps, out_dtype=torch.float32), dim=-1)
        out = draft.new_full((draft.shape[0], self.vocab), float("-inf"))
        out[:, self.target_ids] = draft
        return out


def load_eagle3(model: str, target_config: ModelConfig, dtype: torch.dtype, device) -> Eagle3Draft:
    path = draft_dir(model)
    cfg, raw = draft_config(path), read_config(path, _bad)
    target_hidden = raw.get("target_hidden_size") or cfg.hidden_size
    for key, mine in (("hidden_size", cfg.hidden_size), ("target_hidden_size", target_hidden),
                      ("vocab_size", cfg.vocab_size)):
        theirs = getattr(target_config, key.removeprefix("target_"))
        if mine != theirs:
            raise _bad(f"its {key} is {mine}, the target's {theirs}")
    tensors = {name.removeprefix("model."): t for name, t in read_tensors(path, _bad).items()}
    if "fc.weight" not in tensors or not any(name.startswith("midlayer.") for name in tensors):
        raise _bad("an EAGLE-3 checkpoint holds fc.weight and midlayer.* (this looks like EAGLE-1's: give method "
                   "'eagle')")
    num_features = len(feature_layers(model, target_config.num_hidden_layers))
    fc = tensors["fc.weight"]
    if tuple(fc.shape) != (cfg.hidden_size, num_features * target_hidden):
        raise _bad(f"fc.weight is {list(fc.shape)}, expected [{cfg.hidden_size}, {num_features * target_hidden}] "
                   f"({num_features} target layers fused)")
    draft_vocab = raw.get("draft_vocab_size") or cfg.vocab_size
    draft = Eagle3Draft(cfg, num_features, draft_vocab, cfg.vocab_size, "embed_tokens.weight" in tensors,
                        bool(raw.get("norm_before_residual", False)))
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    if d2t is not None:
        ids = torch.arange(draft_vocab) + d2t.long() if d2t.shape == (draft_vocab,) else None
        if ids is None or int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or len(ids.unique()) != draft_vocab:
            raise _bad(f"d2t must map each of the {draft_vocab} draft tokens to a distinct target token "
                       f"(draft id + d2t[draft id] in [0, {cfg.vocab_size}))")
        draft.target_ids.copy_(ids)
    elif draft_vocab != cfg.vocab_size:
        raise _bad(f"its draft vocabulary ({draft_vocab}) is not the target's, and it has no d2t to map it")
    return filled_draft(draft, tensors, "midlayer.", dtype, device)
