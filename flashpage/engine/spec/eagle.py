"""EAGLE (Li et al., 2024): a one-layer draft that predicts the target's next feature from its last one, and
EAGLE-2's dynamic draft trees.

The draft's element at position p reads the target's feature there, f_p (its final-normed hidden state, as the
target's LM head sees it), and the next token t_{p+1}: x = fc([embed(t_{p+1}); f_p]), then one decoder layer with
its own paged KV cache gives f'_{p+1}, and the target's LM head on it gives the draft's distribution of t_{p+2}.
Drafting past the known tokens feeds its own f' back with the token it guesses.

Features come from the target's steps (the runner keeps every token's hidden state, `StepResult.hidden`): a prompt
chunk's or a decode token's all, a verified tree's along the kept path only (`observe`). Before proposing, the
draft computes its elements for every position whose feature it has been given (its cache then holds only
elements of the target's own features), so the guesses of the last call are rolled back by simply writing over
them. A prompt read from the prefix cache has no features for its cached part: the draft sees zeros there (its
guesses get worse, the output stays exact); so do samples forked off a prompt (n > 1).

EAGLE-2's tree (engine/spec/tree_search.py): `tree_width` tokens a node, `tree_width` nodes expanded a level, up
to num_speculative_tokens levels, the `tree_width` x num_speculative_tokens likeliest nodes kept (fewer than 64).
A level's draft step recomputes every expanded node with the tree mask (kernels/tree.py), as the mask covers
only a step's own queries. The engine walks the tree by the target's draws: lossless, greedy or sampled.

Checkpoint layout (EAGLE-1; EAGLE-2 uses the same checkpoints): a directory with a LlamaConfig config.json (one
hidden layer) and `fc.weight` [hidden, 2 hidden] (`fc.bias` where trained with one) and `layers.0.*` (a Llama
decoder layer, whose `input_layernorm` the published drafts leave out: the fused input is used as it is), in
model.safetensors or pytorch_model.bin, optionally under `model.`. The embedding and LM head are the target's.
EAGLE-3's drafts (`method: "eagle3"`, engine/spec/eagle3.py) read other features and have their own head; the
proposer here serves both through the draft's `fuse`, `embed`, `forward` and `logprobs`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from flashpage.config import ModelConfig
from flashpage.engine.inputs import prepare_inputs
from flashpage.engine.spec.checkpoint import checkpoint_dir, read_config, read_tensors
from flashpage.engine.spec.tree_search import Node, grow_trees, level_plan
from flashpage.engine.step import SeqStep, StepPlan
from flashpage.errors import ParameterError
from flashpage.kernels.reference import rms_norm
from flashpage.kernels.tree import MAX_TREE_TOKENS
from flashpage.kv import BlockManager, allocate_kv_caches, kv_bytes_per_block
from flashpage.model.llama import DecoderLayer, load_tensor, unfilled
from flashpage.model.rope import rope_cos_sin, rope_inv_freq
from flashpage.parallel.group import TensorParallel

SETTING = "speculative_config.model"


def _bad(message: str) -> ParameterError:
    return ParameterError(SETTING, f"speculative_config: EAGLE draft: {message}")


def draft_dir(model: str) -> Path:
    return checkpoint_dir(model, "an EAGLE draft", _bad)


def draft_config(path: Path) -> ModelConfig:
    """The draft's decoder-layer shape (a Llama layer, whatever architecture its config names: EAGLE-3's say
    LlamaForCausalLMEagle3)."""
    raw = read_config(path, _bad)
    try:
        return ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    except (ValueError, KeyError, TypeError) as e:
        raise _bad(str(e)) from None


def eagle_bytes_per_block(model: str, block_size: int) -> int:
    """Its KV cache's bytes per block (counted at 4 bytes an element: the target's dtype is not known yet)."""
    c = draft_config(draft_dir(model))
    return kv_bytes_per_block(1, block_size, c.num_key_value_heads, c.head_dim, torch.float32)


class EagleDraft(nn.Module):
    def __init__(self, cfg: ModelConfig, fc_bias: bool, input_norm: bool):
        super().__init__()
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layer = DecoderLayer(cfg, TensorParallel())
        if not input_norm:
            self.layer.input_layernorm = None
        self._inv_freq = rope_inv_freq(cfg)

    def fuse(self, ops, target, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's features of the target's (its last layer's output): final-normed, as its LM head sees them."""
        norm = target.norm
        return rms_norm(hidden.float(), norm.weight.float(), norm.eps).to(hidden.dtype)

    def embed(self, target, ids: torch.Tensor) -> torch.Tensor:
        return target.embed_tokens(ids)

    def forward(self, ops, embedded: torch.Tensor, features: torch.Tensor, meta, kv_cache) -> torch.Tensor:
        """The next features f' [T, hidden] of elements (embedded tokens, features) at meta.positions."""
        if self._inv_freq.device != embedded.device:
            self._inv_freq = self._inv_freq.to(embedded.device)
        x = ops.linear(torch.cat([embedded, features.to(embedded.dtype)], -1), self.fc.weight, self.fc.bias)
        cos, sin = rope_cos_sin(self._inv_freq, meta.positions, x.dtype)
        return self.layer(ops, x, cos, sin, meta, kv_cache)

    def logprobs(self, ops, target, features: torch.Tensor) -> torch.Tensor:
        """The draft's log-probabilities of the next token: the target's LM head on predicted features."""
        head = target.embed_tokens if target.lm_head is None else target.lm_head
        return torch.log_softmax(ops.linear(features, head.weight, out_dtype=torch.float32), dim=-1)


def load_eagle(model: str, target_config: ModelConfig, dtype: torch.dtype, device) -> EagleDraft:
    path = draft_dir(model)
    cfg = draft_config(path)
    for key in ("hidden_size", "vocab_size"):
        if getattr(cfg, key) != getattr(target_config, key):
            raise _bad(f"its {key} is {getattr(cfg, key)}, the target's {getattr(target_config, key)}")
    tensors = {name.removeprefix("model."): t for name, t in read_tensors(path, _bad).items()}
    if any(name.startswith(("midlayer.", "d2t", "t2d")) for name in tensors):
        raise _bad("this is an EAGLE-3 checkpoint (midlayer, d2t): give method 'eagle3'")
    draft = EagleDraft(cfg, "fc.bias" in tensors, "layers.0.input_layernorm.weight" in tensors)
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight"):
        tensors.pop(name, None)  # the target's are used
    return filled_draft(draft, tensors, "layers.0.", dtype, device)


def filled_draft(draft: nn.Module, tensors: dict[str, torch.Tensor], layer_prefix: str, dtype, device) -> nn.Module:
    """The draft with every tensor loaded (`layer_prefix` naming its decoder layer in the checkpoint), on the
    device in the target's dtype, frozen; `_bad` names a tensor that does not fit and the parameters left empty."""
    params = dict(draft.named_parameters())
    filled: dict[str, int] = {}
    for name, tensor in tensors.items():
        try:
            load_tensor(draft, params, name.replace(layer_prefix, "layer.", 1), tensor, filled, label=name)
        except ValueError as e:
            raise _bad(str(e)) from None
    missing = unfilled(draft, params, filled)
    if missing:
        raise _bad(f"the checkpoint lacks tensors for {', '.join(missing[:4])}")
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)


class EagleProposer:
    probs = None  # proposals are point masses, verified by the draws decoding would make

    def __init__(self, spec, cfg, target):
        c = target.config
        if spec.method == "eagle3":
            from flashpage.engine.spec.eagle3 import load_eagle3
            self.draft = load_eagle3(spec.model, c, target.dtype, target.device)
        else:
            self.draft = load_eagle(spec.model, c, target.dtype, target.device)
        self.target = target.model
        self.ops, self.device = target.model.ops, target.device
        d = self.draft.layer.self_attn
        self.block_size = cfg.block_size
        self.kv = allocate_kv_caches(1, target.num_blocks, cfg.block_size, d.num_kv_heads, d.head_dim, target.dtype,
                                     target.device)
        self.bm = BlockManager(target.num_blocks, cfg.block_size, enable_prefix_caching=False)
        self.depth, self.width = spec.num_speculative_tokens, spec.tree_width
        self.size = min(self.width * self.depth, MAX_TREE_TOKENS - 1)
        self.max_len = target.cfg.max_model_len
        self.features: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (first position, target features)
        self.done: dict[int, int] = {}  # seq_id -> elements in the draft cache (positions 0 .. done - 1)
        self.verified: dict[int, torch.Tensor] = {}  # seq_id -> a verify step's features, until `observe`

    # ----- the target's features --------------------------------------------------------------------------
    def _fused(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.draft.fuse(self.ops, self.target, hidden)

    def _add(self, seq_id: int, position: int, feats: torch.Tensor) -> None:
        """Features of positions `position` .. on; earlier ones it replaces (a preempted sequence recomputed)."""
        start, have = self.features.get(seq_id, (self.done.get(seq_id, 0), feats[:0]))
        end = start + len(have)
        if position < self.done.get(seq_id, 0):
            self.done[seq_id] = position
        if position < start:
            start, have = position, feats[:0]
        elif position <= end:
            have = have[:position - start]
        else:  # positions the target did not compute here (a prefix-cache hit): zeros
            have = torch.cat([have, have.new_zeros(position - end, have.shape[1])])
        self.features[seq_id] = (start, torch.cat([have, feats]))

    def take_features(self, plan: StepPlan, hidden: torch.Tensor | None) -> None:
        """A step's features: all of a prompt chunk's or decode token's; a verify step's wait for `observe`."""
        if hidden is None:
            return
        row = 0
        for s in plan.seqs:
            feats = self._fused(hidden[row:row + len(s.token_ids)])
            row += len(s.token_ids)
            if s.num_logits > 1:
                self.verified[s.seq_id] = feats
            else:
                self._add(s.seq_id, s.positions[0], feats)

    def observe(self, seq, drawn: list[int], emitted: list[int], hidden) -> None:
        feats = self.verified.pop(seq.seq_id, None)
        if feats is not None:  # the last token's and the kept nodes' (emitted rows are theirs), at consecutive places
            self._add(seq.seq_id, seq.num_computed - len(emitted), feats[emitted])

    # ----- drafting -----------------------------------------------------------------------------------------
    def _run(self, plan: StepPlan, features: torch.Tensor) -> torch.Tensor:
        inputs = prepare_inputs(plan, self.block_size, self.device)
        embedded = self.draft.embed(self.target, inputs.ids)
        return self.draft(self.ops, embedded, features, inputs.meta, self.kv[0])

    def _logprobs(self, feats: torch.Tensor) -> torch.Tensor:
        return self.draft.logprobs(self.ops, self.target, feats)

    @torch.inference_mode()
    def propose(self, running) -> None:
        live = {s.seq_id for s in running}
        for seq_id in [i for i in self.bm.tables if i not in live]:  # finished or preempted
            self.release(seq_id)
        plan, feats, drafting = StepPlan(), [], []
        for seq in running:
            last = len(seq.token_ids) - 1  # the last token's position: elements up to last - 1 are known
            start, have = self.features.get(seq.seq_id, (0, None))
            done = self.done.get(seq.seq_id, 0)
            if seq.num_uncomputed != 1 or seq.num_pending or have is None or start > done or \
                    start + len(have) < last or seq.room(self.max_len) < 2:
                continue
            if seq.seq_id not in self.bm.tables:
                self.bm.allocate_prefix(seq.seq_id, [])
            self.bm.truncate(seq.seq_id, self.bm.num_tokens[seq.seq_id] - done)
            need = last + self.size
            if self.bm.blocks_needed(seq.seq_id, need) > self.bm.num_free_blocks:
                continue
            self.bm.append_slots(seq.seq_id, need - self.bm.num_tokens[seq.seq_id])
            tokens = seq.token_ids[done + 1:last + 1]
            plan.add(SeqStep(seq.seq_id, tokens, list(range(done, last)), list(self.bm.table(seq.seq_id)),
                             num_logits=1))
            feats.append(have[done - start:last - start])
            # the last element is computed again next time (its output gives the first level of the tree)
            self.features[seq.seq_id] = (last - 1, have[last - 1 - start:])
            self.done[seq.seq_id] = last - 1
            drafting.append(seq)
        if not drafting:
            return
        out = self._run(plan, torch.cat(feats))
        ends = [sum(len(s.token_ids) for s in plan.seqs[:i + 1]) - 1 for i in range(len(plan.seqs))]
        root = out[ends]  # each sequence's last element's output: the first level's distribution
        outputs: dict[tuple[int, int], torch.Tensor] = {}  # (sequence, node) -> its element's output

        def expand(trees: list[list[Node]], expanded: list[list[int]], level: int) -> torch.Tensor:
            """Every expanded node computed again as a tree (the mask covers a step's own queries only)."""
            plan, rows = level_plan([s.seq_id for s in drafting], [len(s.token_ids) - 2 for s in drafting],
                                    [list(self.bm.table(s.seq_id)) for s in drafting], trees, expanded, level)
            feats = [root[i] if nodes[n].parent < 0 else outputs[i, nodes[n].parent]
                     for i, (nodes, order) in enumerate(zip(trees, expanded)) for n in order]
            out = self._run(plan, torch.stack(feats))
            row = 0
            for i, order in enumerate(expanded):
                for j, n in enumerate(order):
                    outputs[i, n] = out[row + j]
                row += len(order)
            return self._logprobs(out[rows])

        for seq, (tokens, parents, _) in zip(drafting, grow_trees(self._logprobs(root), expand, self.width,
                                                                   self.depth, self.size)):
            seq.proposal, seq.proposal_parents = tokens, parents

    def release(self, seq_id: int) -> None:
        self.bm.free_sequence(seq_id)
        for d in (self.features, self.done, self.verified):
            d.pop(seq_id, None)
