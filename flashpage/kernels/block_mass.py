"""The estimate behind key blocks chosen per KV head (`flashpage.kernels.block_sparse`): `reference.block_mass` as
one Triton kernel. Its measurements are in docs/kernel-notes.md ("The block-mass estimate")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.block_sparse import BlockChoice


@triton.jit
def _block_mass_kernel(Q, K, BlockTable, Rows, Runs, Out, Scratch, ScratchM, sm_scale_log2, first_run, chunks,
                       kv_heads, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_oh, stride_or,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SAMPLE: tl.constexpr,
                       SAMPLES: tl.constexpr, QUERY_BLOCKS: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr, RUN: tl.constexpr,
                       CHUNK: tl.constexpr, ONE_HEAD: tl.constexpr, UPCAST: tl.constexpr):
    """One program per QUERY_BLOCKS choosing query blocks of one sequence (a part of a run of up to RUN) and KV
    head: the rows of their sampled queries (every SAMPLE-th from each block's last, SAMPLES per block at most, each
    of the group's heads, or with ONE_HEAD the next head for the next sampled query) as one operand, so the
    sequence's keys are read once for all of them.

    One pass over the keys, as FlashAttention's: each row's running maximum and sum, and its sum over each
    candidate block relative to that maximum. Those sums are gathered CHUNK blocks at a time and written to the
    program's scratch with the maximum they are relative to (`chunks` chunks of [BLOCK_R, CHUNK] in fp16, of
    [BLOCK_R] in float32). At the end, each row's sums become probabilities (its final maximum and sum known) and
    are summed over each query block's rows: a sum across warps, done once per chunk."""
    # KV heads vary fastest, and the runs go last to first: their later query blocks see more keys, and the longest
    # programs are best started first
    h = tl.program_id(0) % kv_heads
    program = tl.num_programs(0) // kv_heads - 1 - tl.program_id(0) // kv_heads
    run = first_run + program // (RUN // QUERY_BLOCKS)
    r0 = tl.load(Runs + run * 2) + program % (RUN // QUERY_BLOCKS) * QUERY_BLOCKS
    r_end = tl.load(Runs + run * 2) + tl.load(Runs + run * 2 + 1)
    if r0 < r_end:
        i = tl.arange(0, BLOCK_R)
        HEADS: tl.constexpr = 1 if ONE_HEAD else GROUP  # rows per sampled query
        block_of = i // (SAMPLES * HEADS)  # the row's query block in this program
        r = r0 + block_of
        r_ok = (r < r_end) & (block_of < QUERY_BLOCKS)
        seq = tl.load(Rows + r0 * 8 + 1)
        q0 = tl.load(Rows + r * 8 + 2, mask=r_ok, other=0)
        n_q = tl.load(Rows + r * 8 + 3, mask=r_ok, other=0)
        pos0 = tl.load(Rows + r * 8 + 4, mask=r_ok, other=0)
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
        qb = tl.arange(0, QUERY_BLOCKS)
        qb_ok = r0 + qb < r_end
        qb_first = tl.load(Rows + (r0 + qb) * 8 + 5, mask=qb_ok, other=0)
        qb_end = qb_first + tl.load(Rows + (r0 + qb) * 8 + 6, mask=qb_ok, other=0)  # one past its last candidate
        b_first = tl.min(tl.where(qb_ok, qb_first, 1 << 30))
        b_end = tl.max(tl.where(qb_ok, qb_end, 0))
        c = tl.arange(0, CHUNK)
        slot = (program * kv_heads + h).to(tl.int64)
        sums_at = Scratch + slot * chunks * BLOCK_R * CHUNK + i[:, None] * CHUNK + c[None, :]
        maxima_at = ScratchM + slot * chunks * BLOCK_R + i

        # Rows that are not queries (q = 0) score 0 where tiles go unmasked: their maximum starts at 0, and their
        # 1 / sum is taken as 0. The others start finite, so a key no row sees never gives inf - inf.
        m = tl.where(row_ok, -1e30, 0.0)
        l = tl.zeros([BLOCK_R], dtype=tl.float32)
        sums = tl.zeros([BLOCK_R, CHUNK], dtype=tl.float32)  # the current chunk's, relative to m
        n_keys = tl.max(tl.where(row_ok, q_pos + 1, 0))
        seen_by_all = tl.min(tl.where(row_ok, q_pos + 1, 1 << 30))  # keys below this need no causal mask
        for b in range(0, tl.cdiv(n_keys, BLOCK)):
            block_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
            for t in range(0, BLOCK, BLOCK_N):
                start = b * BLOCK + t
                if start + BLOCK_N <= seen_by_all:
                    s = _scores(q, K, BlockTable, seq, h, start, n_keys, q_pos, row_ok, d, d_ok, stride_kb,
                                stride_ks, stride_kh, stride_bt, BLOCK_N, PAGE_SIZE, False, UPCAST) * sm_scale_log2
                else:
                    s = _scores(q, K, BlockTable, seq, h, start, n_keys, q_pos, row_ok, d, d_ok, stride_kb,
                                stride_ks, stride_kh, stride_bt, BLOCK_N, PAGE_SIZE, True, UPCAST) * sm_scale_log2
                m_new = tl.maximum(m, tl.max(s, 1))
                alpha = tl.exp2(m - m_new)
                tile_sum = tl.sum(tl.exp2(s - m_new[:, None]), 1)
                l = l * alpha + tile_sum
                block_sum = block_sum * alpha + tile_sum
                sums = sums * alpha[:, None]
                m = m_new
            if (b >= b_first) & (b < b_end):
                column = (b - b_first) % CHUNK
                sums = tl.where(c[None, :] == column, block_sum[:, None], sums)
                if (column == CHUNK - 1) | (b == b_end - 1):
                    chunk = (b - b_first) // CHUNK
                    tl.store(sums_at + chunk * BLOCK_R * CHUNK, sums.to(tl.float16))
                    tl.store(maxima_at + chunk * BLOCK_R, m)
                    sums = tl.zeros([BLOCK_R, CHUNK], dtype=tl.float32)

        tl.debug_barrier()  # the scratch, written by the program's threads, is read by others
        inv_l = tl.where(row_ok & (l > 0), 1.0 / l, 0.0)
        for chunk in range(0, tl.cdiv(b_end - b_first, CHUNK)):
            weight = tl.exp2(tl.load(maxima_at + chunk * BLOCK_R) - m) * inv_l
            mass = tl.load(sums_at + chunk * BLOCK_R * CHUNK).to(tl.float32) * weight[:, None]
            blocks = b_first + chunk * CHUNK + c
            for j in tl.static_range(QUERY_BLOCKS):  # each query block's rows' sum, where b is its candidate
                j_first = tl.sum(tl.where(qb == j, qb_first, 0))
                tl.store(Out + h * stride_oh + (r0 + j) * stride_or + blocks - j_first,
                         tl.sum(tl.where((block_of == j)[:, None], mass, 0.0), 0),
                         mask=(blocks >= j_first) & (blocks < tl.sum(tl.where(qb == j, qb_end, 0))))


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


def block_mass(q, kv_cache, block_table, choice: BlockChoice, softmax_scale=None, scratch_bytes=256 << 20):
    """`reference.block_mass` as one Triton kernel (`_block_mass_kernel`): float32 [Hkv, R, max_candidates].
    Its scratch takes up to scratch_bytes; more runs than that holds go to further launches."""
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
    block_r = max(16, triton.next_power_of_2(query_blocks * per_block))
    chunk = 32 if block_r <= 64 else 16  # (32 at 128 rows spills registers)
    # a program's query blocks reach from the first's first candidate to the last's last
    chunks = -(-(choice.max_candidates + query_blocks) // chunk)
    programs_per_run = BlockChoice.RUN_LENGTH // query_blocks
    per_run = programs_per_run * hkv * chunks * block_r * (2 * chunk + 4)  # bytes of scratch
    runs = choice.runs.shape[0]
    launch_runs = max(1, min(runs, scratch_bytes // per_run))
    slots = launch_runs * programs_per_run * hkv
    sums = torch.empty(slots * chunks * block_r * chunk, dtype=torch.float16, device=q.device)
    maxima = torch.empty(slots * chunks * block_r, dtype=torch.float32, device=q.device)
    interpret = q.device.type == "cpu"
    for first_run in range(0, runs, launch_runs):
        _block_mass_kernel[(min(launch_runs, runs - first_run) * programs_per_run * hkv,)](
            q, k, block_table, choice.rows, choice.runs, out, sums, maxima, scale, first_run,
            chunks, hkv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), block_table.stride(0),
            out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
            SAMPLE=choice.sample, SAMPLES=samples, QUERY_BLOCKS=query_blocks, BLOCK_R=block_r, BLOCK_N=64,
            BLOCK=choice.block, PAGE_SIZE=page, RUN=BlockChoice.RUN_LENGTH, CHUNK=chunk, ONE_HEAD=choice.one_head,
            UPCAST=interpret and q.dtype == torch.bfloat16, num_warps=max(4, block_r // 16), num_stages=3)
    return out
