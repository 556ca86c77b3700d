"""Scheduler: continuous batching with chunked prefill and preemption by recomputation.

Each step it first continues running sequences (decodes and unfinished prompt chunks), oldest first, within the
token budget; if the cache cannot hold them it preempts the newest running sequence (its blocks are freed and
it goes back to the front of the queue to be recomputed later, losing nothing). Then, if nothing was preempted,
it admits waiting sequences, reusing cached prompt blocks. The step goes to the runner as one `StepPlan`; each
sequence whose last token it computes gets a sample row, and a PENDING token that the next step may already
compute on (the runner reads it on the device).

A decoding sequence with a speculative proposal (`seq.proposal`, made by the engine's proposer before each step)
computes its last token and the proposed ones in one step, with a sample row after each; `accept` then keeps the
verified part and gives the rest of the slots back. Proposals are cut, never preempting anyone, where budget or
blocks run short.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from flashpage.engine.sequence import FINISHED, PENDING, RUNNING, WAITING, Sequence
from flashpage.engine.step import SampleSpec, SeqStep, StepPlan
from flashpage.kernels.tree import ancestors, depths, within_depth
from flashpage.kv import BlockManager, slot

log = logging.getLogger("flashpage.scheduler")


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache at first admission
        self.prefix_hits = 0  # of those, tokens whose cached K/V was reused
        self.moves: list[tuple[int, int]] = []  # verified trees' slot moves, for the next plan

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        out = StepPlan(moves=self.moves)
        self.moves = []
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.last_pending:
                i += 1
                continue
            n = min(seq.num_uncomputed, budget)
            proposal, parents = [], None
            if seq.proposal and n == seq.num_uncomputed and not seq.num_pending:
                room = seq.room(self.max_model_len) - 1  # proposed tokens a path may still emit
                if seq.proposal_parents:  # a tree: cut to the room's depth, then verified whole or not at all
                    proposal, parents = within_depth(seq.proposal, seq.proposal_parents, room)
                    if len(proposal) > budget - n or seq.num_computed + n + len(proposal) > self.max_model_len:
                        proposal, parents = [], None  # (its slots too stay within the context)
                else:
                    proposal = seq.proposal[:max(0, min(budget - n, room))]
            if proposal and self.bm.blocks_needed(seq.seq_id, seq.num_computed + n + len(proposal)) > \
                    self.bm.num_free_blocks:
                proposal, parents = [], None
            while self.bm.blocks_needed(seq.seq_id, seq.num_computed + n) > self.bm.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != RUNNING:
                break  # it was the newest: everything after it is preempted too
            forked = self._schedule(seq, n, out, proposal, seq.proposal_rows, parents if proposal else None)
            budget -= n + len(proposal)
            i += 1 + forked  # samples forked off it now are computed from the next step on
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Prompt log-probs need every prompt token's logits: such a prompt is computed whole (as vLLM does).
            lookup = seq.token_ids[:1] if seq.params.prompt_logprobs is not None else seq.token_ids
            cached = self.bm.allocate_prefix(seq.seq_id, lookup)
            n = min(len(seq.token_ids) - cached, budget)
            if self.bm.blocks_needed(seq.seq_id, cached + n) > self.bm.num_free_blocks:
                self.bm.free_sequence(seq.seq_id)
                break
            self.waiting.popleft()
            if seq.num_computed == 0 and not seq.output_token_ids:  # first admission, not a recompute
                self.prefix_queries += (len(lookup) - 1) // self.bm.block_size * self.bm.block_size
                self.prefix_hits += cached
            seq.status, seq.num_computed = RUNNING, cached
            seq.first_scheduled_time = seq.first_scheduled_time or time.time()
            self.running.append(seq)
            self._schedule(seq, n, out)
            budget -= n
        return out

    def _schedule(self, seq: Sequence, n: int, plan: StepPlan, proposal: list[int] = (),
                  draft_rows: list[int] | None = None, parents: list[int] | None = None) -> int:
        """Put `n` of its tokens (and a proposal: a chain, or a tree of `parents`) in the plan; returns how many
        samples it forked off (n > 1)."""
        start, m = seq.num_computed, len(proposal)
        plan.copies += self.bm.append_slots(seq.seq_id, n + m)
        seq.num_computed += n
        self.commit(seq)
        tokens = seq.token_ids[start:start + n] + list(proposal)
        from_row = None
        if tokens[-1] == PENDING:  # only ever the last token of a decode
            tokens[-1], from_row = 0, seq.pending_row
        step = SeqStep(seq.seq_id, tokens, list(range(start, start + n + m)), list(self.bm.table(seq.seq_id)),
                       last_token_from_row=from_row)
        if parents:  # n == 1: the last token, then the tree by depth
            step.tree = [-1] + [p + 1 for p in parents]
            step.positions = [start + d for d in depths(step.tree)]
        last_prompt = seq.num_prompt_tokens - 1
        # The prompt tokens this chunk predicts that no step has scored yet: counted as asked for, not as read back
        # (the chunk before may still be in flight), so a preempted prompt recomputed in other chunks is scored
        # once, from where it got to.
        first, end = seq.prompt_logprobs_asked, min(start + n, last_prompt) + 1
        if seq.params.prompt_logprobs is not None and start < first < end:
            step.prompt_logprobs = seq.params.prompt_logprobs
            step.prompt_targets = seq.token_ids[first:end]
            step.prompt_skip = first - 1 - start
            seq.prompt_logprobs_asked = end
        if seq.num_computed == len(seq.token_ids):  # its last token: draw the next one (forks draw from it too)
            step.num_logits = 1 + m
        row = plan.add(step)
        if m:  # a row after the last token and after each proposed one; the first is the PENDING token
            seq.verifying, seq.verifying_parents = list(proposal), parents
            # each row draws after the proposed tokens on its way: a chain's first i, a tree node's path
            paths = [[proposal[j - 1] for j in ancestors(step.tree, i)[1:]] for i in range(m + 1)] if parents else \
                [proposal[:i] for i in range(m + 1)]
            specs = [SampleSpec(seq.seq_id, row + i, seq.sample_row(paths[i])) for i in range(m + 1)]
            if draft_rows is not None:  # drawn from a draft model's distribution: the rejection sampler checks them,
                # at the row drawing after each token's parent (a chain's: the row before it)
                for i, (token, q_row) in enumerate(zip(proposal, draft_rows)):
                    spec = specs[parents[i] + 1 if parents else i]
                    spec.draft_tokens, spec.draft_row = (*spec.draft_tokens, token), q_row
            self._expect_token(seq, len(plan.samples))
            plan.samples += specs
        elif step.num_logits:
            for s in [seq, *seq.forks]:
                if s is not seq:
                    self.fork(seq, s)
                plan.samples.append(SampleSpec(s.seq_id, row, s.sample_row()))
                self._expect_token(s, len(plan.samples) - 1)
            forked, seq.forks = len(seq.forks), []
            return forked
        return 0

    def _expect_token(self, seq: Sequence, sample_row: int) -> None:
        """The step will sample the sequence's next token: hold its place until it is read back."""
        seq.token_ids.append(PENDING)
        seq.num_pending += 1
        seq.pending_row = sample_row
        seq.last_pending = seq.ends_at(len(seq.token_ids), self.max_model_len)

    def accept(self, seq: Sequence, num_accepted: int, kept: list[int] | None = None) -> None:
        """Its step verified the first `num_accepted` proposed tokens (of a tree: the proposed tokens `kept`, a
        path from the root): their K/V is kept, moved into place by the next step, the rest given back."""
        if kept:
            table = self.bm.table(seq.seq_id)
            self.moves += [(slot(table, seq.num_computed + i, self.bm.block_size),
                            slot(table, seq.num_computed + k, self.bm.block_size)) for k, i in enumerate(kept) if i != k]
        seq.num_computed += num_accepted
        self.bm.truncate(seq.seq_id, len(seq.verifying) - num_accepted)
        seq.verifying, seq.verifying_parents = [], None

    def commit(self, seq: Sequence) -> None:
        """Publish the sequence's known tokens whose K/V is computed (or being computed) to the prefix cache."""
        if seq.status == RUNNING:  # (a preempted sequence holds no blocks until it is recomputed)
            self.bm.commit(seq.seq_id, seq.token_ids, min(seq.num_computed, seq.num_known))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq.seq_id)
        seq.status, seq.num_computed = WAITING, 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.warning("preempted request %s (sample %d, %d tokens): KV cache full; it will be recomputed",
                    seq.request_id, seq.index, len(seq.token_ids))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A running child sharing the parent's blocks (n > 1 after the prompt)."""
        self.bm.fork(parent.seq_id, child.seq_id)
        child.status, child.num_computed = RUNNING, parent.num_computed
        self.running.insert(self.running.index(parent) + 1, child)

    def finish(self, seq: Sequence) -> None:
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:  # (a sample not yet forked off its parent is in neither list)
            self.waiting.remove(seq)
        self.bm.free_sequence(seq.seq_id)
        seq.status = FINISHED
