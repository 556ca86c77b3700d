"""A draft model proposing tokens for the target to verify (Leviathan et al.; Chen et al.).

The draft runs in its own ModelRunner (its own paged KV cache, block manager and CUDA graphs). Before a target
step it brings each decoding sequence's draft cache up to the tokens now known, then drafts k tokens one step at a
time, each fed back on the device, and reads them back once. It draws from its own distribution at the request's
temperature, q = softmax(draft logits / T), and keeps those rows for the target's rejection sampler, which
applies every sampling parameter to the target's distribution p. On the next call the tokens it fed back are
checked against what was accepted, and its cache is rolled back to the first mismatch. With `tree_width` > 1 it
proposes token trees instead, grown as EAGLE-2 grows them (engine/spec/tree_search.py): of its likeliest tokens
for a greedy request, which the target verifies by its own draws; for a sampled one each node's children drawn
without replacement from q, which the target verifies by multi-branch speculative sampling (SpecInfer).
"""

from __future__ import annotations

import dataclasses

import torch

from flashpage.engine.config import EngineConfig
from flashpage.engine.inputs import upload
from flashpage.engine.runner import ModelRunner, resolve_device
from flashpage.engine.sequence import Sequence
from flashpage.engine.spec.config import SpeculativeConfig
from flashpage.engine.spec.tree_search import Node, grow_trees, level_plan
from flashpage.engine.step import SampleRow, SampleSpec, SeqStep, StepPlan
from flashpage.errors import ParameterError
from flashpage.kernels.tree import MAX_TREE_TOKENS
from flashpage.kv import BlockManager, kv_bytes_per_block
from flashpage.loader import LoadedModel, load_model
from flashpage.sampling_params import SamplingParams


def load_draft(spec: SpeculativeConfig, cfg: EngineConfig) -> LoadedModel:
    """The draft's weights, in the target's dtype on its device (dummy weights where the target's are)."""
    try:
        return load_model(spec.model, load_format=cfg.load_format, dtype=cfg.dtype, device=resolve_device(cfg.device),
                          seed=cfg.seed + 1)
    except ValueError as e:
        raise ParameterError("speculative_config.model", f"speculative_config: draft model: {e}") from None


def draft_bytes_per_block(draft: LoadedModel, block_size: int) -> int:
    c, param = draft.config, next(draft.model.parameters())
    return kv_bytes_per_block(c.num_hidden_layers, block_size, c.num_key_value_heads, c.head_dim, param.dtype)


class DraftProposer:
    def __init__(self, spec: SpeculativeConfig, cfg: EngineConfig, target: ModelRunner, draft: LoadedModel):
        if draft.config.vocab_size != target.config.vocab_size or (
                draft.tokenizer and target.tokenizer and draft.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab()):
            raise ParameterError("speculative_config.model", f"speculative_config: the draft model {spec.model!r} has "
                                 f"another vocabulary than the target (sizes {draft.config.vocab_size} and "
                                 f"{target.config.vocab_size}); a draft must share the target's tokenizer")
        max_len = min(target.cfg.max_model_len, draft.config.max_position_embeddings)
        draft_cfg = dataclasses.replace(target.cfg, model=spec.model, revision=None, gguf_file=None,
                                        speculative_config=None, max_model_len=max_len,
                                        num_gpu_blocks=target.num_blocks, enable_prefix_caching=False)
        self.runner = ModelRunner(draft_cfg, draft)
        self.bm = BlockManager(target.num_blocks, cfg.block_size, enable_prefix_caching=False)
        self.k, self.max_len = spec.num_speculative_tokens, max_len
        self.width = spec.tree_width  # > 1: token trees (engine/spec/tree_search.py), not sampled chains
        self.size = min(self.width * self.k, MAX_TREE_TOKENS - 1)
        self.target_max_len, self.max_tokens = target.cfg.max_model_len, cfg.max_num_batched_tokens
        self.computed: dict[int, int] = {}  # seq id -> tokens whose draft K/V is in the draft cache
        self.fed: dict[int, tuple[int, list[int]]] = {}  # seq id -> (position, drafted tokens computed from there)
        self.probs: torch.Tensor | None = None  # [proposed tokens, V] the q rows of the last proposals
        self._params: dict[float, SamplingParams] = {}

    def release(self, seq_id: int) -> None:
        self.bm.free_sequence(seq_id)
        self.computed.pop(seq_id, None)
        self.fed.pop(seq_id, None)

    def propose(self, running: list[Sequence]) -> None:
        live = {s.seq_id for s in running}
        for seq_id in [i for i in self.bm.tables if i not in live]:  # finished or preempted
            self.release(seq_id)
        if self.width > 1:
            self._propose_trees(running)
            return
        plan, budget, drafting = StepPlan(), self.max_tokens, []
        for seq in running:
            known = len(seq.token_ids)
            k = min(self.k, seq.room(self.target_max_len) - 1, self.max_len + 1 - known)
            if seq.num_uncomputed != 1 or seq.num_pending or k < 1 or budget < 1:
                continue
            start = self._roll_back(seq)
            n = min(known - start, budget)
            end = known + k - 1 if start + n == known else start + n  # slots through the last drafted token fed
            if self.bm.blocks_needed(seq.seq_id, end) > self.bm.num_free_blocks:
                continue
            self.bm.append_slots(seq.seq_id, end - self.bm.num_tokens[seq.seq_id])
            step = SeqStep(seq.seq_id, seq.token_ids[start:start + n], list(range(start, start + n)),
                           list(self.bm.table(seq.seq_id)), num_logits=int(start + n == known))
            self.computed[seq.seq_id] = start + n
            budget -= n
            row = plan.add(step)
            if step.num_logits:
                plan.samples.append(SampleSpec(seq.seq_id, row, self._row(seq, known)))
                drafting.append((seq, k))
        if not drafting:  # catching up on long prompts only
            if plan.seqs:
                self.runner.step(plan)
            return
        futures, probs = [], []
        for j in range(max(k for _, k in drafting)):
            if j:  # draft token j - 1 is fed back from the last step's samples (on the device)
                plan, rows = StepPlan(), [i for i, (_, k) in enumerate(drafting) if k > j]
                for n, i in enumerate(rows):
                    seq = drafting[i][0]
                    pos = len(seq.token_ids) + j - 1
                    plan.add(SeqStep(seq.seq_id, [0], [pos], list(self.bm.table(seq.seq_id)), num_logits=1,
                                     last_token_from_row=futures[-1][1].index(i)))
                    plan.samples.append(SampleSpec(seq.seq_id, n, self._row(seq, pos + 1)))
            else:
                rows = list(range(len(drafting)))
            futures.append((self.runner.step(plan), rows))
            t = torch.tensor([s.row.params.temperature or 1.0 for s in plan.samples], device=self.runner.device)
            probs.append(torch.softmax(self.runner.last_logits.float() / t[:, None], dim=-1))
        self.probs = torch.cat(probs)
        tokens: list[list[int]] = [[] for _ in drafting]
        rows: list[list[int]] = [[] for _ in drafting]
        offset = 0
        for future, drafted in futures:
            for n, (i, t) in enumerate(zip(drafted, future.result().sampled)):
                tokens[i].append(t.token_id)
                rows[i].append(offset + n)
            offset += len(drafted)
        for (seq, _), drafted, q_rows in zip(drafting, tokens, rows):
            seq.proposal, seq.proposal_rows = drafted, q_rows
            self.fed[seq.seq_id] = (len(seq.token_ids), drafted[:-1])
            self.computed[seq.seq_id] += len(drafted) - 1

    @torch.inference_mode()
    def _propose_trees(self, running: list[Sequence]) -> None:
        """Token trees (EAGLE-2's search, engine/spec/tree_search.py): a greedy request's of the draft's likeliest
        tokens, a sampled one's drawn from q at the request's temperature (and q's rows kept for the target's
        sampler). The draft's cache keeps known tokens only: each call computes the new ones (the last token again:
        its logits start the tree), then one step a level, every expanded node computed again as a tree (the mask
        covers a step's own queries only)."""
        self.probs = None
        plan, budget, drafting = StepPlan(), self.max_tokens, []
        for seq in running:
            known = len(seq.token_ids)
            if seq.num_uncomputed != 1 or seq.num_pending or budget < 1 or seq.room(self.target_max_len) < 2 or \
                    known + self.size > self.max_len:
                continue
            start = self._roll_back(seq)
            n = min(known - start, budget)
            end = known + self.size if start + n == known else start + n
            if self.bm.blocks_needed(seq.seq_id, end) > self.bm.num_free_blocks:
                continue
            self.bm.append_slots(seq.seq_id, end - self.bm.num_tokens[seq.seq_id])
            plan.add(SeqStep(seq.seq_id, seq.token_ids[start:start + n], list(range(start, start + n)),
                             list(self.bm.table(seq.seq_id)), num_logits=int(start + n == known)))
            self.computed[seq.seq_id] = start + n
            budget -= n
            if start + n == known:
                drafting.append(seq)
        if not plan.seqs:
            return
        logits = self.runner.forward(plan)[0]
        if not drafting:  # catching up on long prompts only
            return
        dev = logits.device
        temperature = [s.params.temperature or 1.0 for s in drafting]  # (a greedy request's tree is q's top-k)
        generators = [torch.Generator(dev).manual_seed(hash((s.seed, s.index, len(s.token_ids), "tree")) % 2**63)
                      if s.params.temperature > 0 else None for s in drafting]
        q_rows = [torch.log_softmax(logits / upload(temperature, torch.float32, dev)[:, None], dim=-1)]

        def expand(trees: list[list[Node]], expanded: list[list[int]], level: int) -> torch.Tensor:
            plan, rows = level_plan([s.seq_id for s in drafting], [len(s.token_ids) - 1 for s in drafting],
                                    [list(self.bm.table(s.seq_id)) for s in drafting], trees, expanded, level)
            owners = [i for i, (nodes, order) in enumerate(zip(trees, expanded)) for n in order
                      if nodes[n].depth == level]
            logits = self.runner.forward(plan)[0][rows]
            q_rows.append(torch.log_softmax(logits / upload([temperature[i] for i in owners], torch.float32,
                                                            dev)[:, None], dim=-1))
            return q_rows[-1]

        trees = grow_trees(q_rows[0], expand, self.width, self.k, self.size, generators)
        if any(generators):
            self.probs = torch.cat(q_rows).exp()
        for seq, g, (tokens, parents, rows) in zip(drafting, generators, trees):
            seq.proposal, seq.proposal_parents = tokens, parents
            seq.proposal_rows = rows if g is not None else None

    def _roll_back(self, seq: Sequence) -> int:
        """Tokens whose draft K/V still holds: drafted tokens fed back count up to the first the target did not
        keep, and the last token is always computed again (its logits draw the first proposal; the target may not
        have scheduled the sequence at all). Gives back the draft slots after them; returns their count."""
        seq_id = seq.seq_id
        if seq_id not in self.bm.tables:
            self.bm.allocate_prefix(seq_id, [])
            self.computed[seq_id] = 0
        if seq_id in self.fed:
            pos, fed = self.fed.pop(seq_id)
            kept = next((j for j, t in enumerate(fed) if pos + j >= len(seq.token_ids) or seq.token_ids[pos + j] != t),
                        len(fed))
            self.computed[seq_id] = pos + kept
        self.computed[seq_id] = min(self.computed[seq_id], len(seq.token_ids) - 1)
        self.bm.truncate(seq_id, self.bm.num_tokens[seq_id] - self.computed[seq_id])
        return self.computed[seq_id]

    def _row(self, seq: Sequence, position: int) -> SampleRow:
        """The draft's draw for `position`: the request's temperature alone, its own random stream."""
        t = seq.params.temperature
        if t not in self._params:
            self._params[t] = SamplingParams(temperature=t, max_tokens=None)
        return SampleRow(self._params[t], (), 0, hash((seq.seed, seq.index, position, "draft")) % 2**63)
