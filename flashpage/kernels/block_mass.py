"""The estimate behind key blocks chosen per KV head (`flashpage.kernels.block_sparse`): `reference.block_mass` as
one Triton kernel. Its measurements are in docs/kernel-notes.md ("The block-mass estimate")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.block_sparse import BlockChoice


@triton.jit
def _block_mass_kernel(Q, K, BlockTable, Rows, Runs, Out, sm_scale_log2, stride_qt, stride_qh, stride_kb, stride_ks,
                       stride_kh, stride_bt, stride_oh, stride_or, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, SAMPLE: tl.constexpr, SAMPLES: tl.constexpr, QUERY_BLOCKS: tl.constexpr,
                       BLOCK_R: tl.constexpr, SCAN_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, RUN: tl.constexpr, ONE_HEAD: tl.constexpr, UPCAST: tl.constexpr):
    """One program per QUERY_BLOCKS choosing query blocks of one sequence (a part of a run of up to RUN) and KV
    head: the rows of their sampled queries (every SAMPLE-th from each block's last, SAMPLES per block at most, each
    of the group's heads, or with ONE_HEAD the next head for the next query) as one operand, so the sequence's keys
    are read once for all of them. The first pass over the keys up to the last query finds each row's softmax
    maximum and sum; the second sums each query block's rows' probabilities over each of its candidate blocks."""
    run = tl.program_id(0) // (RUN // QUERY_BLOCKS)
    r0 = tl.load(Runs + run * 2) + tl.program_id(0) % (RUN // QUERY_BLOCKS) * QUERY_BLOCKS
    r_end = tl.load(Runs + run * 2) + tl.load(Runs + run * 2 + 1)
    if r0 < r_end:
        h = tl.program_id(1)
        i = tl.arange(0, BLOCK_R)
        HEADS: tl.constexpr = 1 if ONE_HEAD else GROUP  # rows per sampled query
        block_of = i // (SAMPLES * HEADS)  # the row's query block in this program
        r = r0 + block_of
        r_ok = (r < r_end) & (block_of < QUERY_BLOCKS)
        seq = tl.load(Rows + r0 * 8 + 1)
        q0 = tl.load(Rows + r * 8 + 2, mask=r_ok, other=0)
        n_q = tl.load(Rows + r * 8 + 3, mask=r_ok, other=0)
        pos0 = tl.load(Rows + r * 8 + 4, mask=r_ok, other=0)
        first = tl.load(Rows + r * 8 + 5, mask=r_ok, other=0)
        end = first + tl.load(Rows + r * 8 + 6, mask=r_ok, other=0)  # one past the row's last candidate block
        sampled = i // HEADS % SAMPLES  # the row's sampled query: the block's last, the SAMPLE-th before it, ...
        offset = n_q - 1 - sampled * SAMPLE  # its query within its block
        head = h * GROUP + (sampled if ONE_HEAD else i) % GROUP
        row_ok = r_ok & (offset >= 0)
        q_pos = pos0 + offset
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + (q0 + offset)[:, None] * stride_qt + head[:, None] * stride_qh +
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
    per_block = samples * (1 if choice.one_head else group)  # rows
    query_blocks = 1 << max(0, min(BlockChoice.RUN_LENGTH.bit_length() - 1, (128 // per_block).bit_length() - 1))
    rows = triton.next_power_of_2(query_blocks * per_block)
    interpret = q.device.type == "cpu"
    _block_mass_kernel[(choice.runs.shape[0] * (BlockChoice.RUN_LENGTH // query_blocks), hkv)](
        q, k, block_table, choice.rows, choice.runs, out, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        k.stride(2), block_table.stride(0), out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim), SAMPLE=choice.sample, SAMPLES=samples, QUERY_BLOCKS=query_blocks,
        BLOCK_R=max(16, rows), SCAN_N=64, BLOCK_N=64, BLOCK=choice.block, PAGE_SIZE=page,
        RUN=BlockChoice.RUN_LENGTH, ONE_HEAD=choice.one_head, UPCAST=interpret and q.dtype == torch.bfloat16,
        num_warps=4, num_stages=3)
    return out
