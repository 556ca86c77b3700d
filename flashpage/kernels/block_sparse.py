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
last, summed over the group's heads per key block (`block_mass`).

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
import triton
import triton.language as tl


@dataclass(frozen=True)
class BlockSparsePattern:
    block: int  # tokens per block (a multiple of 64: the kernels' key tile)
    sink: int  # first blocks every query sees
    local: int  # blocks of the window, the query's own included (>= 1)
    stride: int  # every stride-th block is a vertical line every query sees; 0: none
    density: float = 0.0  # > 0: key blocks chosen per KV head, up to this share of a query block's causal blocks
    sample: int = 8  # with density: every sample-th query of a block estimates which blocks it attends to

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
        lines = torch.zeros_like(qb)
        if self.stride:  # blocks in [sink, window) with kb % stride == stride - 1: (window // stride) - ...
            lines = torch.clamp(window // self.stride - self.sink // self.stride, min=0)
        if self.density:  # the chosen blocks: the rest of the query block's share
            keep = torch.ceil(self.density * (qb + 1).double() - 1e-9).long()
            lines = torch.clamp(keep - sinks - (qb - window + 1), min=0)
        full_blocks = sinks + lines + (qb - window)  # the window's blocks before the query's own
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
        row = 0  # the sequence's first query's row in the batch
        for seq, (q_len, k_len, table) in enumerate(zip(q_lens, k_lens, tables)):
            row += q_len
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
                        out.choices.append((len(out.q_lens), seq, row - k_len + q0, last - q0, q0, sinks,
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
    most GROUP_ROWS of one sequence, as (first row, rows) int32 [runs, 2] (`block_mass` gives a run's query blocks
    to one program or a few, which read the sequence's keys once for all of them); the most candidates and the
    most chosen blocks of any row; the pattern's block and sample."""
    rows: torch.Tensor
    runs: torch.Tensor
    max_candidates: int
    max_chosen: int
    block: int
    sample: int

    GROUP_ROWS = 8

    @classmethod
    def of(cls, split: SplitBatch, pattern: BlockSparsePattern, upload) -> BlockChoice:
        """`upload(list, dtype)`: a flat host list as a device tensor."""
        runs = []
        for r, c in enumerate(split.choices):
            if not runs or runs[-1][1] == cls.GROUP_ROWS or split.choices[runs[-1][0]][1] != c[1]:
                runs.append([r, 0])
            runs[-1][1] += 1
        flat = upload([x for c in split.choices for x in c] + [x for run in runs for x in run], torch.int32)
        rows, runs_t = flat.split([8 * len(split.choices), 2 * len(runs)])
        return cls(rows.view(-1, 8), runs_t.view(-1, 2), max(c[6] for c in split.choices),
                   max(c[7] for c in split.choices), pattern.block, pattern.sample)


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
    picked = mass.topk(choice.max_chosen, -1).indices  # [Hkv, R, chosen], the best first
    picked = torch.where(used, picked, choice.max_candidates).sort(-1).values  # in position order, unused last
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


@triton.jit
def _block_mass_kernel(Q, K, BlockTable, Rows, Runs, Out, sm_scale_log2, stride_qt, stride_qh, stride_kb, stride_ks,
                       stride_kh, stride_bt, stride_oh, stride_or, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, SAMPLE: tl.constexpr, SAMPLES: tl.constexpr, QUERY_BLOCKS: tl.constexpr,
                       BLOCK_R: tl.constexpr, SCAN_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """One program per QUERY_BLOCKS choosing query blocks of one sequence (a part of a run) and KV head: the rows
    of their sampled queries (every SAMPLE-th from each block's last, SAMPLES per block at most, each of the group's
    heads) as one operand, so the sequence's keys are read once for all of them. The first pass over the keys up
    to the last query finds each row's softmax maximum and sum; the second sums each query block's rows'
    probabilities over each of its candidate blocks."""
    run = tl.program_id(0) // (8 // QUERY_BLOCKS)  # (BlockChoice.GROUP_ROWS)
    r0 = tl.load(Runs + run * 2) + tl.program_id(0) % (8 // QUERY_BLOCKS) * QUERY_BLOCKS
    r_end = tl.load(Runs + run * 2) + tl.load(Runs + run * 2 + 1)
    if r0 < r_end:
        h = tl.program_id(1)
        i = tl.arange(0, BLOCK_R)
        block_of = i // (SAMPLES * GROUP)  # the row's query block in this program
        r = r0 + block_of
        r_ok = (r < r_end) & (block_of < QUERY_BLOCKS)
        seq = tl.load(Rows + r0 * 8 + 1)
        q0 = tl.load(Rows + r * 8 + 2, mask=r_ok, other=0)
        n_q = tl.load(Rows + r * 8 + 3, mask=r_ok, other=0)
        pos0 = tl.load(Rows + r * 8 + 4, mask=r_ok, other=0)
        first = tl.load(Rows + r * 8 + 5, mask=r_ok, other=0)
        end = first + tl.load(Rows + r * 8 + 6, mask=r_ok, other=0)  # one past the row's last candidate block
        offset = n_q - 1 - (i // GROUP % SAMPLES) * SAMPLE  # the row's query within its block
        row_ok = r_ok & (offset >= 0)
        q_pos = pos0 + offset
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + (q0 + offset)[:, None] * stride_qt + (h * GROUP + i % GROUP)[:, None] * stride_qh +
                    d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:  # (the interpreter multiplies bf16 wrongly)
            q = q.to(tl.float32)
        # Rows that are not queries (q = 0) score 0 where tiles go unmasked: their maximum starts at 0, and their
        # 1 / sum is taken as 0. The others start finite, so a key no row sees never gives inf - inf.
        m = tl.where(row_ok, -1e30, 0.0)
        l = tl.zeros([BLOCK_R], dtype=tl.float32)
        n_keys = tl.max(tl.where(row_ok, q_pos + 1, 0))
        seen_by_all = tl.min(tl.where(row_ok, q_pos + 1, 1 << 30))  # keys below this need no causal mask
        for start in range(0, n_keys, SCAN_N):
            if start + SCAN_N <= seen_by_all:
                s = _scores(q, K, BlockTable, seq, h, start, n_keys, q_pos, row_ok, d, d_ok, stride_kb, stride_ks,
                            stride_kh, stride_bt, SCAN_N, PAGE_SIZE, False, UPCAST) * sm_scale_log2
            else:
                s = _scores(q, K, BlockTable, seq, h, start, n_keys, q_pos, row_ok, d, d_ok, stride_kb, stride_ks,
                            stride_kh, stride_bt, SCAN_N, PAGE_SIZE, True, UPCAST) * sm_scale_log2
            m_new = tl.maximum(m, tl.max(s, 1))
            l = l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m = m_new
        inv_l = tl.where(row_ok & (l > 0), 1.0 / l, 0.0)
        for b in range(tl.min(tl.where(r_ok, first, 1 << 30)), tl.max(tl.where(r_ok, end, 0))):
            mass = tl.zeros([BLOCK_R], dtype=tl.float32)
            for t in range(0, BLOCK, BLOCK_N):
                start = b * BLOCK + t
                if start + BLOCK_N <= seen_by_all:
                    s = _scores(q, K, BlockTable, seq, h, start, n_keys, q_pos, row_ok, d, d_ok, stride_kb,
                                stride_ks, stride_kh, stride_bt, BLOCK_N, PAGE_SIZE, False, UPCAST) * sm_scale_log2
                else:
                    s = _scores(q, K, BlockTable, seq, h, start, n_keys, q_pos, row_ok, d, d_ok, stride_kb,
                                stride_ks, stride_kh, stride_bt, BLOCK_N, PAGE_SIZE, True, UPCAST) * sm_scale_log2
                mass += tl.sum(tl.exp2(s - m[:, None]), 1) * inv_l
            for j in tl.static_range(QUERY_BLOCKS):  # each query block's rows' sum, where b is its candidate
                b_first = tl.max(tl.where(block_of == j, first, 0))
                b_end = tl.max(tl.where(block_of == j, end, 0))
                if (b >= b_first) & (b < b_end):
                    tl.store(Out + h * stride_oh + (r0 + j) * stride_or + b - b_first,
                             tl.sum(tl.where(block_of == j, mass, 0.0)))


@triton.jit
def _scores(q, K, BlockTable, seq, h, start, n_keys, q_pos, row_ok, d, d_ok, stride_kb, stride_ks, stride_kh,
            stride_bt, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """q times the keys [start, start + BLOCK_N) of KV head h, gathered through the sequence's block table. MASKED:
    -inf where a row does not see the key (causal), and in rows that are not queries."""
    k_pos = start + tl.arange(0, BLOCK_N)
    k_ok = (k_pos < n_keys) | (not MASKED)
    page = tl.load(BlockTable + seq * stride_bt + k_pos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
    k = tl.load(K + (page * stride_kb + (k_pos % PAGE_SIZE) * stride_ks + h * stride_kh)[None, :] + d[:, None],
                mask=k_ok[None, :] & d_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k)
    if MASKED:
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & row_ok[:, None], s, float("-inf"))
    return s


def block_mass(q, kv_cache, block_table, choice: BlockChoice, softmax_scale=None):
    """`reference.block_mass` as one Triton kernel (`_block_mass_kernel`): float32 [Hkv, R, max_candidates]."""
    hq, dim = q.shape[1], q.shape[2]
    k = kv_cache.k
    hkv, page = k.shape[2], k.shape[1]
    group = hq // hkv
    n = choice.rows.shape[0]
    out = torch.full((hkv, n, choice.max_candidates), float("-inf"), dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    scale = (softmax_scale if softmax_scale is not None else dim**-0.5) * 1.4426950408889634
    samples = -(-choice.block // choice.sample)
    # query blocks per program: about 128 rows (the tensor cores' operand), a power of two that divides a run
    query_blocks = 1 << max(0, min(3, (128 // (samples * group)).bit_length() - 1))
    rows = triton.next_power_of_2(query_blocks * samples * group)
    interpret = q.device.type == "cpu"
    _block_mass_kernel[(choice.runs.shape[0] * (BlockChoice.GROUP_ROWS // query_blocks), hkv)](
        q, k, block_table, choice.rows, choice.runs, out, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        k.stride(2), block_table.stride(0), out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim), SAMPLE=choice.sample, SAMPLES=samples, QUERY_BLOCKS=query_blocks,
        BLOCK_R=max(16, rows), SCAN_N=64, BLOCK_N=64, BLOCK=choice.block, PAGE_SIZE=page,
        UPCAST=interpret and q.dtype == torch.bfloat16, num_warps=4, num_stages=3)
    return out
