"""Medusa heads (Cai et al., 2024): extra LM heads on the target's last hidden state, head i guessing the token
i + 1 places after the one the target's own head draws; a tree of their top-k guesses is verified in one step.

A head is `num_layers` residual blocks x + SiLU(W x + b) and a vocabulary projection, applied to the target's
final-normed hidden state (as the Medusa and vLLM code take it: the base model's output after its last norm).
The hidden state at the row that drew a sequence's last token (kept by the runner, `StepResult.hidden`) gives,
through head i, candidates for the token i + 1 places after that last token. The tree is Medusa's: each node is a
path of ranks (r_1 .. r_d), its token head d's r_d-th guess; the engine walks it by the target's own draws, so
the method is lossless (greedy or sampled), or with typical acceptance (`engine/spec/typical.py`) lossy.

With one guess per head (`tree_width` 1) the tree is a chain of every head's top guess: blockwise parallel
decoding (Stern et al., 2018), whose k heads are exactly these.

Checkpoint layouts read (a directory with config.json, or a Hub id):
- Medusa's own (FasterDecoding/Medusa): config.json with `medusa_num_heads`, `medusa_num_layers`; tensors in
  `medusa_lm_head.safetensors` (or `.pt`) named `{head}.{layer}.linear.weight|bias` and `{head}.{num_layers}.weight`
  (the projection); a whole Medusa-2 model's are the same names under `medusa_head.`.
- vLLM's: config.json with `num_heads`, `num_hidden_layers`; `blocks.{head}.layers.{layer}.weight|bias` and
  `lm_heads.{head}.weight` (optionally under `medusa_heads.`), one shared `lm_heads.0.weight` where
  `original_lm_head` is true.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from flashpage.engine.spec.checkpoint import checkpoint_dir, read_config, read_tensors
from flashpage.errors import ParameterError
from flashpage.kernels.reference import rms_norm
from flashpage.kernels.tree import MAX_TREE_TOKENS

SETTING = "speculative_config.model"
WEIGHT_FILES = ("medusa_lm_head.safetensors", "model.safetensors", "medusa_lm_head.pt", "pytorch_model.bin")
# Guessed chance that head d's r-th guess is right, for the default tree (no calibration data at hand): the
# Medusa paper's Vicuna-7B heads were right at top-1 about 0.6 for the first head, falling by head, and a
# lower rank adds less each time.
FIRST_HEAD_TOP1, PER_HEAD, PER_RANK = 0.6, 0.8, 0.5


def _bad(message: str) -> ParameterError:
    return ParameterError(SETTING, f"speculative_config: Medusa heads: {message}")


def heads_dir(model: str) -> Path:
    return checkpoint_dir(model, "Medusa heads", _bad)


def read_layout(path: Path) -> tuple[int, int, dict]:
    """(heads, residual blocks per head, config) of the checkpoint in `path`."""
    config = read_config(path, _bad)
    heads = config.get("medusa_num_heads", config.get("num_heads"))
    layers = config.get("medusa_num_layers", config.get("num_hidden_layers", 1))
    if not isinstance(heads, int) or heads < 1 or not isinstance(layers, int) or layers < 0:
        raise _bad(f"{path / 'config.json'} names no head count (medusa_num_heads or num_heads) and block count")
    if config.get("truncated_vocab_size", config.get("vocab_size")) != config.get("vocab_size"):
        raise _bad("a truncated vocabulary (truncated_vocab_size) is not supported")
    return heads, layers, config


def with_head_count(cfg):
    """`cfg` with a Medusa config's num_speculative_tokens filled in where left out: all the checkpoint's heads
    (checked against the heads there where given). Other configs unchanged."""
    spec = cfg.speculative
    if spec is None or spec.method != "medusa":
        return cfg
    heads = read_layout(heads_dir(spec.model))[0]
    k = spec.num_speculative_tokens
    if k is not None and k > heads:
        raise ParameterError("speculative_config.num_speculative_tokens", f"speculative_config: num_speculative_tokens"
                             f" is {k}, but the Medusa checkpoint has {heads} heads")
    if k is None and spec.medusa_choices and max(map(len, spec.medusa_choices)) > heads:
        raise ParameterError("speculative_config.medusa_choices", f"speculative_config: medusa_choices has paths "
                             f"deeper than the checkpoint's {heads} heads")
    return dataclasses.replace(cfg, speculative_config={**cfg.speculative_config, "num_speculative_tokens": k or heads})


def _our_name(name: str, layers: int) -> str | None:
    """A checkpoint tensor's name in MedusaHeads, or None where it is no head's (a Medusa-2 model's base weights)."""
    for prefix in ("medusa_heads.", "medusa_head."):
        name = name.removeprefix(prefix)
    if name.startswith(("blocks.", "lm_heads.")):
        return name
    m = re.fullmatch(r"(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)", name)
    if m is None:
        return None
    head, layer, kind = int(m[1]), int(m[2]), m[3]
    return f"lm_heads.{head}.{kind}" if layer == layers else f"blocks.{head}.layers.{layer}.{kind}"


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, shared_lm_head: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"layers": nn.ModuleList(
            nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))}) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False)
                                      for _ in range(1 if shared_lm_head else num_heads))

    def forward(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """x: [B, hidden] the target's final-normed hidden states. Returns float32 logits [num_heads, B, vocab]."""
        out = []
        for i in range(num_heads):
            y = x
            for layer in self.blocks[i]["layers"]:
                y = y + F.silu(layer(y))
            out.append(self.lm_heads[min(i, len(self.lm_heads) - 1)](y).float())
        return torch.stack(out)


def load_medusa(model: str, hidden_size: int, vocab_size: int, dtype: torch.dtype, device) -> MedusaHeads:
    """The heads of checkpoint `model`, checked against the target's hidden size and vocabulary."""
    path = heads_dir(model)
    num_heads, num_layers, config = read_layout(path)
    shared = bool(config.get("original_lm_head", False))
    for key, ours in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if config.get(key, ours) != ours:
            raise _bad(f"their {key} is {config[key]}, the target's {ours}")
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers, shared)
    params = dict(heads.named_parameters())
    filled = set()
    for name, tensor in read_tensors(path, _bad, WEIGHT_FILES).items():
        ours = _our_name(name, num_layers)
        if ours is None or (shared and ours.startswith("lm_heads.") and ours != "lm_heads.0.weight"):
            continue
        if ours not in params:
            raise _bad(f"tensor {name!r} has no place in {num_heads} heads of {num_layers} blocks")
        if tuple(tensor.shape) != tuple(params[ours].shape):
            what = "vocabulary" if ours.startswith("lm_heads.") and tensor.shape[0] != vocab_size else "hidden size"
            raise _bad(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[ours].shape)} "
                       f"(the heads' {what} does not match the target's)")
        params[ours].data.copy_(tensor)
        filled.add(ours)
    missing = sorted(set(params) - filled)
    if missing:
        raise _bad(f"the checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:4])}")
    return heads.to(device=device, dtype=dtype).eval()


def default_tree(depth: int, width: int) -> list[tuple[int, ...]]:
    """Medusa's tree format (paths of ranks) with up to width x depth nodes (at most MAX_TREE_TOKENS - 1), at most
    `width` children a node: the paths most likely to be right under the guessed per-head, per-rank accuracy,
    chosen best first."""
    size = min(width * depth, MAX_TREE_TOKENS - 1)

    def chance(d: int, r: int) -> float:
        return FIRST_HEAD_TOP1 * PER_HEAD**d * PER_RANK**r

    frontier, chosen = [(-chance(0, 0), (0,))], []
    while frontier and len(chosen) < size:
        value, path = heapq.heappop(frontier)
        chosen.append(path)
        if path[-1] + 1 < width:  # its next sibling
            sibling = (*path[:-1], path[-1] + 1)
            heapq.heappush(frontier, (value / chance(len(path) - 1, path[-1]) * chance(len(path) - 1, path[-1] + 1),
                                      sibling))
        if len(path) < depth:  # its first child
            heapq.heappush(frontier, (value * chance(len(path), 0), (*path, 0)))
    return sorted(chosen, key=lambda p: (len(p), p))


class MedusaProposer:
    probs = None  # proposals are point masses, verified by the draws decoding would make

    def __init__(self, spec, target):
        c = target.config
        self.heads = load_medusa(spec.model, c.hidden_size, c.vocab_size, target.dtype, target.device)
        self.depth = spec.num_speculative_tokens
        choices = spec.medusa_choices or default_tree(self.depth, spec.tree_width)
        if max(len(p) for p in choices) > self.depth:
            raise ParameterError("speculative_config.medusa_choices", "speculative_config: medusa_choices has paths "
                                 f"deeper than num_speculative_tokens ({self.depth}), the heads used")
        self.choices = sorted(choices, key=lambda p: (len(p), p))
        self.parents = [self.choices.index(p[:-1]) if len(p) > 1 else -1 for p in self.choices]
        self.chain = self.parents == list(range(-1, len(self.parents) - 1))
        self.top = max(max(p) for p in self.choices) + 1
        self.norm = target.model.norm
        self.hidden: dict[int, torch.Tensor] = {}  # seq_id -> the hidden state that drew its last token

    def observe(self, seq, drawn: list[int], emitted: list[int], hidden: torch.Tensor | None) -> None:
        """After every step that drew tokens for `seq`: keep the hidden state at the row of its last token."""
        self.hidden[seq.seq_id] = hidden[emitted[-1]]

    @torch.inference_mode()
    def propose(self, running) -> None:
        ready = [s for s in running if s.num_uncomputed == 1 and not s.num_pending and s.seq_id in self.hidden]
        if not ready:
            return
        h = torch.stack([self.hidden.pop(s.seq_id) for s in ready])
        x = rms_norm(h.float(), self.norm.weight.float(), self.norm.eps)
        logits = self.heads(x.to(self.norm.weight.dtype), self.depth)
        guesses = logits.topk(self.top, dim=-1).indices.tolist()  # [head][seq][rank]
        for n, seq in enumerate(ready):
            seq.proposal = [guesses[len(p) - 1][n][p[-1]] for p in self.choices]
            seq.proposal_parents = None if self.chain else list(self.parents)

    def release(self, seq_id: int) -> None:
        self.hidden.pop(seq_id, None)
