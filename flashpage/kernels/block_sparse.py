"""Block-sparse attention patterns for prefill (`sparse_attention={"method": "block", ...}`).

Positions are cut into blocks of `block` tokens. A query in block qb sees a key in block kb <= qb (and causally,
within its own block) when kb is one of the first `sink` blocks (global tokens, attention sinks), or lies within
`local` blocks of qb (a sliding window of whole blocks, qb's own included), or, with `stride` > 0, is a vertical
line: kb % stride == stride - 1 (the strided pattern of Sparse Transformers; BigBird's and Longformer's global
and window tokens are the first two; MInference's vertical lines the third). The same pattern for every head.
The paged prefill kernel walks only the key tiles a query tile can see (`attention._attend_sequence`): the
sinks and the vertical lines whole, the window masked by this rule.
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
