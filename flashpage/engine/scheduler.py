"""Scheduler: continuous batching with chunked prefill and preemption by recomputation.

Each step it first continues running sequences (decodes and unfinished prompt chunks), oldest first, within the
token budget; if the cache cannot hold them it preempts the newest running sequence (its blocks are freed and
it goes back to the front of the queue to be recomputed later, losing nothing). Then, if nothing was preempted,
it admits waiting sequences, reusing cached prompt blocks. The step is handed to the runner as one
`SchedulerOutput`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from flashpage.engine.sequence import FINISHED, RUNNING, WAITING, Sequence
from flashpage.kv import BlockManager, CopyOp

log = logging.getLogger("flashpage.scheduler")


@dataclass
class ScheduledSeq:
    seq_id: int
    token_ids: list[int]  # the tokens to compute this step
    start: int  # position of the first of them
    block_table: list[int]
    sample: bool  # this step reaches the sequence's last token: its logits pick the next one
    prompt_logits: bool  # return logits for every prompt token computed this step


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)  # block copies (copy-on-write) to do before the step


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache at first admission
        self.prefix_hits = 0  # of those, tokens whose cached K/V was reused

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.last_pending:
                i += 1
                continue
            n = min(seq.num_uncomputed, budget)
            while self.bm.blocks_needed(seq.seq_id, seq.num_computed + n) > self.bm.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != RUNNING:
                break  # it was the newest: everything after it is preempted too
            self._schedule(seq, n, out)
            budget -= n
            i += 1
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
            self.running.append(seq)
            self._schedule(seq, n, out)
            budget -= n
        return out

    def _schedule(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        start = seq.num_computed
        out.copies += self.bm.append_slots(seq.seq_id, seq.token_ids, n)
        seq.num_computed += n
        out.seqs.append(ScheduledSeq(
            seq_id=seq.seq_id, token_ids=seq.token_ids[start:start + n], start=start,
            block_table=list(self.bm.table(seq.seq_id)), sample=seq.num_computed == len(seq.token_ids),
            prompt_logits=seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens
            and seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens,
        ))

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
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        self.bm.free_sequence(seq.seq_id)
        seq.status = FINISHED
