"""Block-sparse attention for prefill (`sparse_attention={"method": "block", ...}`).

Positions are cut into blocks of `block` tokens. A query in block qb sees a key in block kb <= qb (and causally,
within its own block) when kb is one of the first `sink` blocks (global tokens, attention sinks), or lies within
`local` blocks of qb (a sliding window of whole blocks, qb's own included), or, with `stride` > 0, is a vertical
line: kb % stride == stride - 1 (the strided pattern of Sparse Transformers; BigBird's and Longformer's global
and window tokens are the first two; MInference's vertical lines the third). The same pattern for every head.

With `density` instead of lines, each query block also sees the key blocks its queries attend to most, chosen per
KV head and layer as the prompt is prefilled (MInference's block-sparse index, FlexPrefill and XAttention choose
blocks from an estimate of this kind): up to `density` of its causal blocks in all, the forced ones (sinks,
window) included. The estimate is the exact attention of every `sample`-th of its queries, counted back from its
last, in each of the group's heads (or, `one_head`, in one of them, the next for the next sampled query), summed
per key block (`block_mass`: `reference.block_mass`, and in Triton `kernels/block_mass.py`).

No kernel knows the pattern. `split` turns a step's sequences into ones whose plain causal attention is the
pattern's: each block of a prompt chunk's queries becomes a sequence of its own, whose block table lists only the
cache pages of the blocks those queries see. Any paged prefill kernel then reads only those keys: the Hopper
kernel on sm_90, the portable one elsewhere, the CPU's. Chosen blocks leave a gap in those tables that
`choose_blocks` fills on the device, a table per KV head, with no host sync: how many blocks a query block keeps
follows from positions alone, so the split sequences' lengths are known on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockSparsePattern:
    block: int  # tokens per block (a multiple of 64: the kernels' key tile)
    sink: int  # first blocks every query sees
    local: int  # blocks of the window, the query's own included (>= 1)
    stride: int  # every stride-th block is a vertical line every query sees; 0: none
    density: float = 0.0  # > 0: key blocks chosen per KV head, up to this share of a query block's causal blocks
    sample: int = 8  # with density: every sample-th query of a block estimates which blocks it attends to
    one_head: bool = False  # with density: each sampled query in one of its group's heads (in turn), not all

    def kept_blocks(self, qb: int) -> tuple[int, int, int]:
        """With density: query block qb's (sink blocks, candidates between them and its window, chosen ones)."""
        window = max(qb - self.local + 1, 0)
        sinks = min(self.sink, window)
        forced = sinks + qb - window + 1
        keep = max(math.ceil(self.density * (qb + 1) - 1e-9), forced)
        return sinks, window - sinks, keep - forced

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Boolean [len(q_pos), len(k_pos)]: which keys each query sees (causal included); with density, the
        forced blocks only."""
        qb, kb = (q_pos // self.block)[:, None], (k_pos // self.block)[None, :]
        seen = (kb < self.sink) | (qb - kb < self.local)
        if self.stride:
            seen |= kb % self.stride == self.stride - 1
        return seen & (k_pos[None, :] <= q_pos[:, None])

    def keys_seen(self, q_pos: torch.Tensor) -> torch.Tensor:
        """How many keys each query at q_pos sees (int64), without building the mask (with density, chosen
        blocks included)."""
        qb = q_pos // self.block
        window = torch.clamp(qb - self.local + 1, min=0)  # the window's first block
        sinks = torch.clamp(window, max=self.sink)  # sink blocks before the window
        between = torch.zeros_like(qb)  # blocks seen between the sinks and the window
        if self.stride:  # lines: blocks in [sink, window) with kb % stride == stride - 1
            between = torch.clamp(window // self.stride - self.sink // self.stride, min=0)
        if self.density:  # the chosen blocks: the rest of the query block's share
            keep = torch.ceil(self.density * (qb + 1).double() - 1e-9).long()
            between = torch.clamp(keep - sinks - (qb - window + 1), min=0)
        full_blocks = sinks + between + (qb - window)  # the window's blocks before the query's own
        return full_blocks * self.block + q_pos - qb * self.block + 1

    def split(self, q_lens: list[int], k_lens: list[int], tables: list[list[int]], page: int) -> SplitBatch:
        """Sequences (queries, keys, block table of `page`-slot pages), each querying its last q_lens[i] keys,
        rewritten so that causal attention over the result is this pattern's: a sequence with two or more queries
        becomes one per block of them, whose keys are the blocks that block sees in position order (the sinks and
        vertical lines or chosen blocks before its window, then the window up to its last query). The queries keep
        their order, so the outputs' rows are the same. A sequence decoding one token stays whole (dense). `block`
        must be a multiple of `page`. Chosen blocks' pages are left as zeros, for `choose_blocks`."""
        per_block = self.block // page
        out = SplitBatch([], [], [], [])
        next_row = 0  # the sequence's first query's row in the batch
        for seq, (q_len, k_len, table) in enumerate(zip(q_lens, k_lens, tables)):
            row, next_row = next_row, next_row + q_len
            if q_len < 2:
                out.add(q_len, k_len, table)
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
                chosen = 0
                if self.density:
                    sinks, candidates, chosen = self.kept_blocks(qb)
                    if chosen:
                        q0 = max(first, qb * self.block)
                        out.choices.append((len(out.q_lens), seq, row + q0 - first, last - q0, q0, sinks,
                                            candidates, chosen))
                        pages += [0] * (chosen * per_block)
                pages += table[window * per_block:-(-last // page)]
                out.add(last - max(first, qb * self.block), (len(before) + chosen) * self.block + last - window *
                        self.block, pages)
        return out


@dataclass
class SplitBatch:
    """`BlockSparsePattern.split`'s sequences, and where blocks are chosen: per query block that chooses some,
    (its sequence here, its sequence in the batch, its first query's row, queries, first query's position, first
    candidate block = its page offset // pages per block, candidates, blocks chosen)."""
    q_lens: list[int]
    k_lens: list[int]
    tables: list[list[int]]
    choices: list[tuple[int, int, int, int, int, int, int, int]]

    def add(self, q_len: int, k_len: int, table: list[int]) -> None:
        self.q_lens.append(q_len)
        self.k_lens.append(k_len)
        self.tables.append(table)


@dataclass
class BlockChoice:
    """A step's chosen blocks on the device: `SplitBatch.choices` as int32 [R, 8]; the same rows in runs of at
    most RUN_LENGTH of one sequence, as (first row, rows) int32 [runs, 2] (`block_mass` gives a run's query blocks
    to one program or a few, which read the sequence's keys once for all of them); the most candidates and the
    most chosen blocks of any row; the pattern's block, sample and one_head."""
    rows: torch.Tensor
    runs: torch.Tensor
    max_candidates: int
    max_chosen: int
    block: int
    sample: int
    one_head: bool = False

    RUN_LENGTH = 8  # (a power of two: a program takes a power-of-two share of a run)

    @classmethod
    def of(cls, split: SplitBatch, pattern: BlockSparsePattern, upload) -> BlockChoice:
        """`upload(list, dtype)`: a flat host list as a device tensor."""
        runs = []
        for r, c in enumerate(split.choices):
            if not runs or runs[-1][1] == cls.RUN_LENGTH or split.choices[runs[-1][0]][1] != c[1]:
                runs.append([r, 0])
            runs[-1][1] += 1
        flat = upload([x for c in split.choices for x in c] + [x for run in runs for x in run], torch.int32)
        rows, runs_t = flat.split([8 * len(split.choices), 2 * len(runs)])
        return cls(rows.view(-1, 8), runs_t.view(-1, 2), max(c[6] for c in split.choices),
                   max(c[7] for c in split.choices), pattern.block, pattern.sample, pattern.one_head)


def head_stride(block_table: torch.Tensor) -> int:
    """A block table's stride between KV heads, as the attention kernels take it: [sequences, KV heads, pages]
    gives each head its own pages (`choose_blocks`); [sequences, pages] one for all (0)."""
    return block_table.stride(1) if block_table.dim() == 3 else 0


def choose_blocks(ops, q: torch.Tensor, kv_cache, block_table: torch.Tensor, split_table: torch.Tensor,
                  choice: BlockChoice, softmax_scale: float | None) -> torch.Tensor:
    """The split sequences' block table per KV head, [split sequences, KV heads, pages + 1]: split_table's rows
    with each choosing row's gap filled, per KV head, with the pages of the candidate blocks of highest
    `ops.block_mass` (in position order). `block_table`: the batch's own [sequences, pages]. The last column is
    scratch (the unused ranks' writes land there)."""
    rows = choice.rows.long()
    mass = ops.block_mass(q, kv_cache, block_table, choice, softmax_scale)  # [Hkv, R, candidates]
    hkv, n, device = mass.shape[0], rows.shape[0], q.device
    per_block = choice.block // kv_cache.block_size
    used = torch.arange(choice.max_chosen, device=device) < rows[:, 7, None]  # [R, chosen]
    # [Hkv, R, chosen]: the best candidates in position order, unused slots last
    picked = ops.top_k_positions(mass, rows[:, 7].expand(hkv, n), choice.max_chosen, choice.max_candidates,
                                 torch.int64)
    page_of = (rows[:, 5, None] + picked)[..., None] * per_block + torch.arange(per_block, device=device)
    page_of = page_of.flatten(-2).clamp_max(block_table.shape[1] - 1)  # [Hkv, R, chosen pages]
    pages = block_table[rows[:, 1]].expand(hkv, n, -1).gather(-1, page_of)
    width = split_table.shape[1]
    cols = rows[:, 5, None] * per_block + torch.arange(choice.max_chosen * per_block, device=device)
    cols = torch.where(used.repeat_interleave(per_block, -1), cols, width).expand(hkv, n, -1)
    table = torch.nn.functional.pad(split_table, (0, 1)).expand(hkv, -1, -1).clone()  # [Hkv, split, width + 1]
    chosen_rows = table[:, rows[:, 0]].scatter_(-1, cols, pages.to(table.dtype))
    table[:, rows[:, 0]] = chosen_rows
    return table.transpose(0, 1)
