"""Property-based tests of the KV block manager against a model of the truth."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pytest

from flashpage.kv import BlockManager, slot

BLOCK = 4
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # a tiny alphabet, so prefixes repeat


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), caching=st.booleans())
    def setup(self, num_blocks, caching):
        self.bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=caching)
        self.seqs: dict[int, list[int]] = {}  # the truth: each live sequence's tokens (all with slots)
        self.committed: dict[int, int] = {}  # how many of them are committed (the rest are lookahead)
        self.published: dict[int, list[int]] = {}  # block -> the committed tokens it held when committed
        self.device: dict[int, int] = {}  # simulated KV cache: slot -> token written there
        self.next_id = 0

    def _commit(self, seq_id: int, tokens: list[int], n: int) -> None:
        self.bm.commit(seq_id, tokens, n)
        self.committed[seq_id] = n
        table = self.bm.table(seq_id)
        for i in range(n // BLOCK):
            self.published[table[i]] = tokens[i * BLOCK:(i + 1) * BLOCK]

    def _write(self, seq_id: int, start: int, copies) -> None:
        for c in copies:  # the runner copies whole blocks before the step writes
            for off in range(BLOCK):
                src = c.src * BLOCK + off
                if src in self.device:
                    self.device[c.dst * BLOCK + off] = self.device[src]
        for pos in range(start, len(self.seqs[seq_id])):
            self.device[slot(self.bm.table(seq_id), pos, BLOCK)] = self.seqs[seq_id][pos]

    @rule(prompt=TOKENS)
    def admit(self, prompt):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        cached = self.bm.allocate_prefix(seq_id, prompt)
        assert cached % BLOCK == 0 and cached < len(prompt)
        if self.bm.blocks_needed(seq_id, len(prompt)) > self.bm.num_free_blocks:
            self.bm.free_sequence(seq_id)  # would not fit: the scheduler would not admit it
            return
        self.seqs[seq_id] = list(prompt)
        copies = self.bm.append_slots(seq_id, len(prompt) - cached)
        self._write(seq_id, cached, copies)
        self._commit(seq_id, prompt, len(prompt))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=TOKENS, commit=st.booleans())
    def append(self, data, new, commit):
        """New tokens: known ones (committed at once), or lookahead (proposals a later step verifies)."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[seq_id] + new
        if self.bm.blocks_needed(seq_id, len(tokens)) > self.bm.num_free_blocks:
            return
        start = len(self.seqs[seq_id])
        copies = self.bm.append_slots(seq_id, len(new))
        self.seqs[seq_id] = tokens
        self._write(seq_id, start, copies)
        if commit and self.committed[seq_id] == start:
            self._commit(seq_id, tokens, len(tokens))

    @precondition(lambda self: any(len(t) > self.committed[s] for s, t in self.seqs.items()))
    @rule(data=st.data())
    def verify(self, data):
        """Some lookahead tokens are accepted (committed), the rest rejected (truncated)."""
        seq_id = data.draw(st.sampled_from(sorted(s for s, t in self.seqs.items() if len(t) > self.committed[s])))
        tokens, committed = self.seqs[seq_id], self.committed[seq_id]
        accepted = data.draw(st.integers(0, len(tokens) - committed))
        self._commit(seq_id, tokens, committed + accepted)
        self.bm.truncate(seq_id, len(tokens) - committed - accepted)
        self.seqs[seq_id] = tokens[:committed + accepted]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.seqs[child] = list(self.seqs[parent])
        self.committed[child] = self.committed[parent]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free_sequence(seq_id)
        del self.seqs[seq_id], self.committed[seq_id]

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id, tokens in self.seqs.items():
            assert [self.device.get(slot(self.bm.table(seq_id), p, BLOCK)) for p in range(len(tokens))] == tokens

    @invariant()
    def reference_counts_match_tables_and_no_block_is_lost(self):
        refs = Counter(b for t in self.bm.tables.values() for b in t)
        assert all(self.bm.ref_count[b] == refs.get(b, 0) for b in range(self.bm.num_blocks))
        free, evictable = set(self.bm.free), set(self.bm.evictable)
        assert len(free) == len(self.bm.free) and not free & evictable and not (free | evictable) & set(refs)
        assert free | evictable | set(refs) == set(range(self.bm.num_blocks))
        assert all(b in self.bm.block_hash for b in evictable)
        assert {h: b for b, h in self.bm.block_hash.items()} == self.bm.cached

    @invariant()
    def only_committed_tokens_are_findable(self):
        """A block the prefix cache offers holds, on the device, tokens some sequence committed into it."""
        for block in self.bm.block_hash:
            assert [self.device.get(block * BLOCK + off) for off in range(BLOCK)] == self.published[block]

    @invariant()
    def waste_is_confined_to_last_blocks(self):
        for seq_id, tokens in self.seqs.items():
            assert len(self.bm.table(seq_id)) == -(-len(tokens) // BLOCK)

    def teardown(self):
        if hasattr(self, "bm"):
            for seq_id in list(self.seqs):
                self.bm.free_sequence(seq_id)
            assert self.bm.num_free_blocks == self.bm.num_blocks
            assert all(r == 0 for r in self.bm.ref_count)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase


def test_prefix_lookup_reuses_full_matching_blocks_only():
    bm = BlockManager(16, 4)
    prompt = list(range(10))
    assert bm.allocate_prefix(0, prompt) == 0
    bm.append_slots(0, 10)
    bm.commit(0, prompt, 10)
    assert bm.allocate_prefix(1, prompt[:9] + [99]) == 8  # two full blocks reused; the third differs
    assert bm.table(1)[:2] == bm.table(0)[:2]
    assert bm.allocate_prefix(2, prompt[:8]) == 4  # one token is always left to compute


def test_released_prefix_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(4, 4)
    a = [1, 2, 3, 4, 5]
    bm.allocate_prefix(0, a)
    bm.append_slots(0, 5)
    bm.commit(0, a, 5)
    bm.free_sequence(0)
    assert bm.num_free_blocks == 4 and len(bm.evictable) == 1  # the full block stays cached
    assert bm.allocate_prefix(1, a) == 4
    bm.free_sequence(1)
    b = list(range(100, 116))  # needs all 4 blocks: the cached one is evicted
    bm.allocate_prefix(2, b)
    bm.append_slots(2, 16)
    bm.commit(2, b, 16)
    assert not bm.evictable and bm.allocate_prefix(3, a) == 0


def test_truncated_lookahead_frees_its_blocks_and_is_never_published():
    """Three lookahead slots (proposals to verify), two of them rejected: the block only they used is freed, the
    prefix cache never offers the unverified tokens, and the accepted one is published once committed."""
    bm = BlockManager(8, 4)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    bm.allocate_prefix(0, prompt)
    bm.append_slots(0, 7)
    bm.commit(0, prompt, 7)
    before = list(bm.table(0))
    bm.append_slots(0, 3)  # proposals 8, 9, 10 at positions 7..9: the last two open a third block
    tokens = prompt + [8, 9, 10]
    assert len(bm.table(0)) == 3 and bm.table(0)[:2] == before and bm.num_free_blocks == 5
    third = bm.table(0)[2]
    with_proposals = tokens[:8] + [0]
    assert bm.allocate_prefix(1, with_proposals) == 4  # the block holding the proposal 8 is not findable
    bm.free_sequence(1)
    bm.truncate(0, 2)  # 8 accepted, 9 and 10 rejected
    assert bm.table(0) == before and bm.num_free_blocks == 6 and third in bm.free
    assert bm.allocate_prefix(1, with_proposals) == 4  # still not findable: 8 is not committed yet
    bm.free_sequence(1)
    bm.commit(0, tokens, 8)
    assert bm.allocate_prefix(1, with_proposals) == 8  # now it is
    with pytest.raises(ValueError, match="cannot truncate"):
        bm.truncate(0, 1)  # committed tokens stay
