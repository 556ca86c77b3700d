"""BlockManager: owns the paged KV cache's blocks (PagedAttention) and nothing else.

Blocks of `block_size` token slots live in one pool; each sequence has a block table (its blocks in order).
Blocks carry reference counts, so forked sequences (parallel sampling, beam search) share them; a sequence
about to write into a shared block first gets a private copy (copy-on-write: the manager returns the copy
for the runner to perform on the device).

Prefix caching: a block whose slots all hold committed tokens (known, verified ones) is identified by a hash
chained over its tokens and its parent's hash. New sequences look their full prompt blocks up and reuse them.
Released blocks keep their hash and stay reusable until a free block is needed, when the least recently released
is evicted. Slots are assigned ahead of their tokens (`append_slots`, lookahead included); only `commit` makes
blocks findable, and `truncate` gives back slots of tokens that were rejected, so nothing unverified is ever
reused.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


def slot(block_table: list[int], position: int, block_size: int) -> int:
    """The cache slot (block * block_size + offset) of a sequence's token at `position`."""
    return block_table[position // block_size] * block_size + position % block_size


@dataclass(frozen=True)
class CopyOp:
    src: int  # block to copy from
    dst: int  # block to copy into


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # never used, or released without a hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # released, hashed, reusable; oldest first
        self.cached: dict[int, int] = {}  # hash -> block holding exactly those tokens
        self.block_hash: dict[int, int] = {}  # block -> its hash (full blocks only)
        self.tables: dict[int, list[int]] = {}  # sequence id -> block table
        self.num_tokens: dict[int, int] = {}  # sequence id -> tokens whose slots are assigned
        self.num_committed: dict[int, int] = {}  # sequence id -> leading tokens committed (never truncated)

    # ----- queries --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.evictable)

    def blocks_needed(self, seq_id: int, total_tokens: int) -> int:
        """New blocks a sequence needs to hold `total_tokens` slots (copy-on-write included)."""
        have = len(self.tables.get(seq_id, ()))
        need = max(0, -(-total_tokens // self.block_size) - have)
        table = self.tables.get(seq_id)
        n = self.num_tokens.get(seq_id, 0)
        if table and n % self.block_size and total_tokens > n and self.ref_count[table[-1]] > 1:
            need += 1  # the shared, partly filled last block must be copied before writing
        return need

    def table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def usage(self) -> tuple[int, int]:
        """(blocks in use, tokens stored in them): a shared block counts once, filled to its fullest owner."""
        fill: dict[int, int] = {}
        for seq_id, table in self.tables.items():
            n = self.num_tokens[seq_id]
            for i, b in enumerate(table):
                fill[b] = max(fill.get(b, 0), min(self.block_size, n - i * self.block_size))
        return len(fill), sum(fill.values())

    # ----- lifecycle ----------------------------------------------------------------------------
    def allocate_prefix(self, seq_id: int, prompt: list[int]) -> int:
        """Start a sequence, reusing cached blocks of its prompt. Returns how many tokens need no compute.

        At least one prompt token is always left to compute (its logits start generation). If the sequence
        is then not admitted, `free_sequence` undoes this.
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        table: list[int] = []
        if self.enable_prefix_caching:
            parent = None
            for i in range((len(prompt) - 1) // self.block_size):
                h = self._hash(parent, prompt[i * self.block_size:(i + 1) * self.block_size])
                block = self.cached.get(h)
                if block is None:
                    break
                self._take(block)
                table.append(block)
                parent = h
        self.tables[seq_id] = table
        self.num_tokens[seq_id] = self.num_committed[seq_id] = len(table) * self.block_size
        return self.num_tokens[seq_id]

    def append_slots(self, seq_id: int, num_new: int) -> list[CopyOp]:
        """Assign slots for the next `num_new` tokens (lookahead slots too: `truncate` can give them back).

        Allocates blocks on demand (evicting cached ones if needed) and copies a shared last block before it is
        written. Raises RuntimeError if the pool cannot supply the blocks: check `blocks_needed` first.
        """
        table, start = self.tables[seq_id], self.num_tokens[seq_id]
        end = start + num_new
        if self.blocks_needed(seq_id, end) > self.num_free_blocks:
            raise RuntimeError("out of KV blocks")
        copies = []
        if num_new and start % self.block_size and self.ref_count[table[-1]] > 1:
            old = table[-1]
            table[-1] = self._allocate()
            self._release(old)
            copies.append(CopyOp(old, table[-1]))
        while len(table) * self.block_size < end:
            table.append(self._allocate())
        self.num_tokens[seq_id] = end
        return copies

    def commit(self, seq_id: int, tokens: list[int], num_committed: int) -> None:
        """The sequence's first `num_committed` tokens (of `tokens`, the sequence so far) are final: known and
        verified, their K/V computed or being computed in stream order. Registers the blocks they fill in the
        prefix cache."""
        start, end = self.num_committed[seq_id], num_committed
        if end > self.num_tokens[seq_id]:
            raise ValueError(f"sequence {seq_id}: {end} tokens committed but only {self.num_tokens[seq_id]} have slots")
        if end <= start:
            return
        self.num_committed[seq_id] = end
        if self.enable_prefix_caching:
            for i in range(start // self.block_size, end // self.block_size):
                self._register(self.tables[seq_id], i, tokens)

    def truncate(self, seq_id: int, num_slots: int) -> None:
        """Give back the last `num_slots` slots (tokens that were rejected); blocks left empty are freed."""
        end = self.num_tokens[seq_id] - num_slots
        if num_slots < 0 or end < self.num_committed[seq_id]:
            raise ValueError(f"sequence {seq_id}: cannot truncate {num_slots} of {self.num_tokens[seq_id]} slots "
                             f"({self.num_committed[seq_id]} are committed)")
        table, keep = self.tables[seq_id], -(-end // self.block_size)
        while len(table) > keep:
            self._release(table.pop())
        self.num_tokens[seq_id] = end

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (reference counts go up)."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        self.tables[child_id] = list(self.tables[parent_id])
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        self.num_committed[child_id] = self.num_committed[parent_id]
        for b in self.tables[child_id]:
            self.ref_count[b] += 1

    def free_sequence(self, seq_id: int) -> None:
        for b in reversed(self.tables.pop(seq_id, [])):  # tail first: prefix blocks stay cached longest
            self._release(b)
        self.num_tokens.pop(seq_id, None)
        self.num_committed.pop(seq_id, None)

    # ----- blocks -------------------------------------------------------------------------------
    def _allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash.pop(block)]
        else:
            raise RuntimeError("out of KV blocks")
        self.ref_count[block] = 1
        return block

    def _take(self, block: int) -> None:
        """Reuse a cached block (possibly released and waiting for eviction)."""
        if self.ref_count[block] == 0:
            del self.evictable[block]
        self.ref_count[block] += 1

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if block in self.block_hash:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def _register(self, table: list[int], index: int, tokens: list[int]) -> None:
        """Block `index` of a table just became full: make it findable by its chained hash."""
        block = table[index]
        if block in self.block_hash:
            return
        parent = self.block_hash.get(table[index - 1]) if index else None
        if index and parent is None:
            return  # its parent was never registered, so no lookup can reach this block
        h = self._hash(parent, tokens[index * self.block_size:(index + 1) * self.block_size])
        if h in self.cached:
            return  # the same tokens are cached in another block already
        self.cached[h] = block
        self.block_hash[block] = h

    @staticmethod
    def _hash(parent: int | None, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens)))
