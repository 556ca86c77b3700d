"""Block-sparse attention patterns for prefill (`sparse_attention={"method": "block", ...}`).

Positions are cut into blocks of `block` tokens. A query in block qb sees a key in block kb <= qb (and causally,
within its own block) when kb is one of the first `sink` blocks (global tokens, attention sinks), or lies within
`local` blocks of qb (a sliding window of whole blocks, qb's own included), or, with `stride` > 0, is a vertical
line: kb % stride == stride - 1 (the strided pattern of Sparse Transformers; BigBird's and Longformer's global
and window tokens are the first two; MInference's vertical lines the third). The same pattern for every head.

No kernel knows the pattern. `split` turns a step's sequences into ones whose plain causal attention is the
pattern's: each block of a prompt chunk's queries becomes a sequence of its own, whose block table lists only the
cache pages of the blocks those queries see. Any paged prefill kernel then reads only those keys: the Hopper
kernel on sm_90, the portable one elsewhere, the CPU's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockSparsePattern:
    block: int  # tokens per block (a multiple of 64: the kernels' key tile)
    sink: int  # first blocks every query sees
    local: int  # blocks of the window, the query's own included (>= 1)
    stride: int  # every stride-th block is a vertical line every query sees; 0: none

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Boolean [len(q_pos), len(k_pos)]: which keys each query sees (causal included)."""
        qb, kb = (q_pos // self.block)[:, None], (k_pos // self.block)[None, :]
        seen = (kb < self.sink) | (qb - kb < self.local)
        if self.stride:
            seen |= kb % self.stride == self.stride - 1
        return seen & (k_pos[None, :] <= q_pos[:, None])

    def keys_seen(self, q_pos: torch.Tensor) -> torch.Tensor:
        """How many keys each query at q_pos sees (int64), without building the mask."""
        qb = q_pos // self.block
        window = torch.clamp(qb - self.local + 1, min=0)  # the window's first block
        sinks = torch.clamp(window, max=self.sink)  # sink blocks before the window
        lines = torch.zeros_like(qb)
        if self.stride:  # blocks in [sink, window) with kb % stride == stride - 1: (window // stride) - ...
            lines = torch.clamp(window // self.stride - self.sink // self.stride, min=0)
        full_blocks = sinks + lines + (qb - window)  # the window's blocks before the query's own
        return full_blocks * self.block + q_pos - qb * self.block + 1

    def split(self, q_lens: list[int], k_lens: list[int], tables: list[list[int]], page: int
              ) -> tuple[list[int], list[int], list[list[int]]]:
        """Sequences (queries, keys, block table of `page`-slot pages), each querying its last q_lens[i] keys,
        rewritten so that causal attention over the result is this pattern's: a sequence with two or more queries
        becomes one per block of them, whose keys are the blocks that block sees in position order (the sinks and
        vertical lines before its window, then the window up to its last query). The queries keep their order, so
        the outputs' rows are the same. A sequence decoding one token stays whole (dense). `block` must be a
        multiple of `page`."""
        per_block = self.block // page
        out_q, out_k, out_tables = [], [], []
        for q_len, k_len, table in zip(q_lens, k_lens, tables):
            if q_len < 2:
                out_q.append(q_len)
                out_k.append(k_len)
                out_tables.append(table)
                continue
            first = k_len - q_len  # the first query's position
            for qb in range(first // self.block, -(-k_len // self.block)):
                last = min(k_len, (qb + 1) * self.block)  # one past the block's last query
                window = max(qb - self.local + 1, 0)
                before = list(range(min(self.sink, window)))
                if self.stride:  # the lines past the sinks: kb % stride == stride - 1
                    first_line = self.sink + (self.stride - 1 - self.sink % self.stride) % self.stride
                    before += range(first_line, window, self.stride)
                pages = [p for kb in before for p in table[kb * per_block:(kb + 1) * per_block]]
                pages += table[window * per_block:-(-last // page)]
                out_q.append(last - max(first, qb * self.block))
                out_k.append(len(before) * self.block + last - window * self.block)
                out_tables.append(pages)
        return out_q, out_k, out_tables
