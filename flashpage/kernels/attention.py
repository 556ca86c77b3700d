"""FlashAttention in Triton: varlen prefill, paged prefill/decode, and Flash-Decoding's split-KV.

One kernel serves every case (on a Hopper GPU the prefill goes to `flashpage.kernels.hopper_prefill` instead, where
that kernel takes it). A program owns BLOCK_M *rows* of one sequence and one KV head, where a row is a
(query token, query head of that KV head's group) pair, so each K/V tile is loaded once for the whole GQA group
(decode programs take several sequences in turn when one program each would not fit in one wave).
It walks the sequence's keys in BLOCK_N tiles (contiguous, or through the block table when PAGED; paged decode on
Hopper fetches each tile, 16 keys of one page, with the tensor copy engine, TMA, instead of a gather) with the
online softmax (running max m, running sum l, rescaled accumulator), in base 2. With NUM_SPLITS > 1 the key
range is cut into that many pieces handled by separate programs (Flash-Decoding); each writes its normalised
partial output and its log-sum-exp, and `_merge_splits` combines them.

Masks are bottom-right aligned: the queries of a sequence are its last q_len tokens, so query i sits at key
position k_len - q_len + i. window_size = (left, right) keeps keys in [pos - left, pos + right]; -1 is unbounded.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashpage.kernels import hopper_prefill, pdl
from flashpage.kernels.block_sparse import head_stride
from flashpage.kernels.device import interpreting, sm_count
from flashpage.kernels.fp8 import dequantize_heads, quantize_heads
from flashpage.kernels.pdl import release_next, wait_for_previous
from flashpage.kernels.tree import check_query_mask


@triton.jit
def tile_dot(a, b, UPCAST: tl.constexpr):
    # Triton 3.6's CPU interpreter multiplies bf16 operands wrongly; it gets them in fp32 (GPU code never does).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    # float32 operands get float32 products, as torch's matmul gives by default, not TF32's 10-bit mantissas
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def exact_cast(x, dtype):
    """A tile of the cache in the queries' dtype: a quantized cache's values convert exactly, to bf16 by way of
    float32 (for e4m3 on an H100 that took 0.22 ms at 64x4k instead of 0.31 converting directly, docs/kernel-notes.md;
    and Triton 3.6's interpreter converts int8 to bf16 wrongly), e4m3 to fp16 directly. A tile already in `dtype`
    stays as it is."""
    if x.dtype != dtype:
        if x.dtype == tl.int8 or (x.dtype == tl.float8e4nv and dtype != tl.float16):
            x = x.to(tl.float32)
        x = x.to(dtype)
    return x


@triton.jit
def _byte_pairs(x, KV_SCALES: tl.constexpr, INTERPRET: tl.constexpr):
    """An 8-bit cache's tile read as 16-bit words, each two neighbouring values of a row (the even column in the
    low byte): the even columns' and the odd columns' values, as fp16 tiles (exact for e4m3 and for int8). Read
    this way the tile reaches the registers as a 16-bit one does (`ldmatrix`) instead of byte by byte, and a few
    byte permutes widen four values at a time (docs/kernel-notes.md). The interpreter runs no PTX: it splits the
    bytes with integer operations."""
    if INTERPRET:
        lo = x.to(tl.int8)
        hi = (x >> 8).to(tl.int8)
        if KV_SCALES == 1:
            return (lo.to(tl.float8e4nv, bitcast=True).to(tl.float16),
                    hi.to(tl.float8e4nv, bitcast=True).to(tl.float16))
        return lo.to(tl.float32).to(tl.float16), hi.to(tl.float32).to(tl.float16)
    # $2 holds two words [b3 b2 | b1 b0]: the low bytes (b2 b0) become $0, the high ones (b3 b1) $1
    if KV_SCALES == 1:  # e4m3: two conversions of two values each
        return tl.inline_asm_elementwise(
            asm="""{ .reg .b32 t; .reg .b16 lo, hi;
            prmt.b32 t, $2, 0, 0x3120;
            mov.b32 {lo, hi}, t;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi; }""",
            constraints="=r,=r,r", args=[x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    # int8: each byte + 128 under fp16's exponent of 1024 (0x64..) is 1024 + 128 + value, exactly; less 1152
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 t, lo, hi, bias;
        xor.b32 t, $2, 0x80808080;
        prmt.b32 lo, t, 0x64646464, 0x4240;
        prmt.b32 hi, t, 0x64646464, 0x4341;
        mov.b32 bias, 0x64806480;
        sub.f16x2 $0, lo, bias;
        sub.f16x2 $1, hi, bias; }""",
        constraints="=r,=r,r", args=[x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _attend_tiles(acc, acc_odd, m_i, l_i, q, q_odd, K, V, KScale, VScale, BlockTable, seq, kv_head, q_pos, lo, hi,
                  k_start, sm_scale_log2, window_left, window_right, stride_kt, stride_kh, stride_kb, stride_vt,
                  stride_vh, stride_vb, stride_bt, num_kv_heads, d, d_ok, tree_bits, first_new,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  CAUSAL: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
                  KV_SCALES: tl.constexpr, TREE: tl.constexpr, PAIRS: tl.constexpr, INTERPRET: tl.constexpr):
    """Online softmax over the key tiles in [lo, hi). Unmasked tiles (every row sees every key) skip all masking.
    KV_SCALES == 2: an INT8 cache, each key's and value's scale read beside the tile and applied to its scores and
    probabilities (a quantized cache's values convert to the query's dtype exactly). TREE: the step's own keys
    (from first_new on) are seen by a row only where its bit in tree_bits [BLOCK_M] says so. PAIRS: the copy engine
    reads an 8-bit cache as 16-bit words (`_byte_pairs`); q and acc hold the even columns, q_odd and acc_odd the
    odd ones."""
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        if TMA:  # K/V are descriptors of the cache as [slots, Hkv * D]; a tile lies inside one page
            block = tl.load(BlockTable + seq * stride_bt + start // PAGE_SIZE)
            row = block * PAGE_SIZE + start % PAGE_SIZE
            if PAIRS:
                k, k_odd = _byte_pairs(tl.trans(K.load([row, kv_head * stride_kh])), KV_SCALES, INTERPRET)
            else:
                k = exact_cast(tl.trans(K.load([row, kv_head * stride_kh])), q.dtype)
        elif PAGED:
            block = tl.load(BlockTable + seq * stride_bt + kpos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
            k_row = block * stride_kb + (kpos % PAGE_SIZE) * stride_kt
            v_row = block * stride_vb + (kpos % PAGE_SIZE) * stride_vt
        else:  # K and V may be views of one fused projection: each has its own strides
            k_row = (k_start + kpos).to(tl.int64) * stride_kt
            v_row = (k_start + kpos).to(tl.int64) * stride_vt
        if not TMA:
            k = exact_cast(tl.load(K + k_row[None, :] + kv_head * stride_kh + d[:, None],
                                 mask=k_ok[None, :] & d_ok[:, None], other=0.0), q.dtype)
        s = tile_dot(q, k, UPCAST)
        if PAIRS:
            s += tile_dot(q_odd, k_odd, UPCAST)
        s = s * sm_scale_log2
        if KV_SCALES == 2:  # scales [blocks, Hkv, PAGE_SIZE]; 0 past the end: its scores are masked, 0 * NaN is not
            scale_at = (block.to(tl.int64) * num_kv_heads + kv_head) * PAGE_SIZE + kpos % PAGE_SIZE
            s = s * tl.load(KScale + scale_at, mask=k_ok, other=0.0)[None, :]
        if MASKED:
            # full [M, N] from the start: the runtime ifs below must yield one type on both sides
            visible = tl.broadcast_to(k_ok[None, :], (BLOCK_M, BLOCK_N))
            if CAUSAL:
                visible = visible & (kpos[None, :] <= q_pos[:, None])
            if window_right >= 0:
                visible = visible & (kpos[None, :] <= q_pos[:, None] + window_right)
            if window_left >= 0:
                visible = visible & (kpos[None, :] >= q_pos[:, None] - window_left)
            if TREE:
                j = kpos - first_new
                bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(j, 0), 63).to(tl.int64)[None, :]) & 1
                visible = visible & ((j[None, :] < 0) | (j[None, :] >= 64) | (bit != 0))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA and PAIRS:
            v = V.load([row, kv_head * stride_vh])
            if MASKED:  # slots past the sequence's end hold anything, NaN included, and 0 * NaN is NaN
                v = tl.where(k_ok[:, None], v, 0)
            v, v_odd = _byte_pairs(v, KV_SCALES, INTERPRET)
        elif TMA:
            v = exact_cast(V.load([row, kv_head * stride_vh]), q.dtype)
            if MASKED:  # slots past the sequence's end hold anything, NaN included, and 0 * NaN is NaN
                v = tl.where(k_ok[:, None], v, 0.0)
        else:
            v = exact_cast(tl.load(V + v_row[:, None] + kv_head * stride_vh + d[None, :],
                                 mask=k_ok[:, None] & d_ok[None, :], other=0.0), q.dtype)
        if KV_SCALES == 2:
            p = p * tl.load(VScale + scale_at, mask=k_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, UPCAST)
        if PAIRS:
            acc_odd = acc_odd * alpha[:, None] + tile_dot(p.to(v_odd.dtype), v_odd, UPCAST)
        m_i = m_new
    return acc, acc_odd, m_i, l_i


@triton.jit
def _attend_sequence(
    seq, pid_m, kv_head, split,
    Q, K, V, KScale, VScale, Out, PartOut, PartLse, CuSeqlensQ, CuSeqlensK, SeqLensK, BlockTable, TreeMask,
    sm_scale_log2, window_left, window_right, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_kb, stride_vt, stride_vh, stride_vb, stride_ot, stride_oh,
    stride_bt, stride_bth, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MASK_EVERY_TILE: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr, KV_SCALES: tl.constexpr,
    TREE: tl.constexpr, PAIRS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One program's work on one sequence: its row tile pid_m of KV head kv_head, over its split of the keys. A
    block table per KV head ([sequences, KV heads, pages], stride_bth; 0: one table for all heads) serves key
    blocks chosen per head (`flashpage.kernels.block_sparse`)."""
    BlockTable += kv_head * stride_bth
    q_start = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_start
    if pid_m * BLOCK_M >= q_len * GROUP:  # a row tile past this sequence's queries
        return
    if PAGED:
        k_len = tl.load(SeqLensK + seq)
        k_start = 0
    else:
        k_start = tl.load(CuSeqlensK + seq)
        k_len = tl.load(CuSeqlensK + seq + 1) - k_start

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_odd = q
    if PAIRS:  # q: the even columns, q_odd: the odd ones
        q, q_odd = tl.split(tl.reshape(q, [BLOCK_M, BLOCK_D // 2, 2]))

    # The keys any row of this tile can see: [lo, hi).
    q_pos = k_len - q_len + tok
    first_pos = k_len - q_len + (pid_m * BLOCK_M) // GROUP
    last_pos = tl.minimum(k_len - q_len + (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, k_len - 1)
    lo = k_len * 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(hi, last_pos + 1)
    if window_right >= 0:
        hi = tl.minimum(hi, last_pos + window_right + 1)
    if window_left >= 0:
        lo = tl.maximum(0, first_pos - window_left)
    lo = (lo // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:  # this program's share of the tiles: splits differ by one tile at most
        tiles = tl.cdiv(hi - lo, BLOCK_N)
        first = lo
        lo = first + (split * tiles // NUM_SPLITS) * BLOCK_N
        hi = tl.minimum(hi, first + ((split + 1) * tiles // NUM_SPLITS) * BLOCK_N)
    # Whole tiles below every row's diagonal need no mask (it pays where compute-bound, i.e. not for decode);
    # with a window, every tile is masked.
    unmasked_hi = lo
    # A token tree: the step's own keys are masked by each row's bits (TreeMask: bit j of row i set where the
    # sequence's query i sees its query j, its ancestors and itself); every key before them is seen.
    first_new = k_len - q_len
    tree_bits = tl.zeros([BLOCK_M], dtype=tl.int64)
    if TREE:
        tree_bits = tl.load(TreeMask + q_start + tok, mask=row_ok, other=0)
    if not MASK_EVERY_TILE and window_left < 0 and window_right < 0:
        bound = tl.minimum(hi, first_pos + 1) if CAUSAL else hi
        if TREE:
            bound = tl.minimum(bound, first_new)
        unmasked_hi = lo + tl.maximum(bound - lo, 0) // BLOCK_N * BLOCK_N

    # A quantized cache's scales (flashpage.kv.cache): an FP8 cache's, one per KV head, scale the scores and the
    # output; an INT8 cache's, one per key, are applied tile by tile. Over an FP8 cache, and over an INT8 one read
    # in pairs, the products run in fp16: queries are clamped to its range, and probabilities keep three more bits
    # than in bf16.
    v_scale = 1.0
    if KV_SCALES == 1:
        sm_scale_log2 = sm_scale_log2 * tl.load(KScale + kv_head)
        v_scale = tl.load(VScale + kv_head)
    if KV_SCALES == 1 or PAIRS:  # e4m3 widens to fp16 in one instruction (to bf16 by way of float32 in four)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        q_odd = tl.clamp(q_odd.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D // (1 + PAIRS)], dtype=tl.float32)
    acc_odd = acc
    if not MASK_EVERY_TILE:
        acc, acc_odd, m_i, l_i = _attend_tiles(
            acc, acc_odd, m_i, l_i, q, q_odd, K, V, KScale, VScale, BlockTable, seq, kv_head, q_pos, lo, unmasked_hi,
            k_start, sm_scale_log2, window_left, window_right, stride_kt, stride_kh, stride_kb, stride_vt, stride_vh,
            stride_vb, stride_bt, num_kv_heads, d, d_ok, tree_bits, first_new, BLOCK_M, BLOCK_N, PAGED, PAGE_SIZE,
            CAUSAL, False, TMA, UPCAST, KV_SCALES, TREE, PAIRS, INTERPRET)
    acc, acc_odd, m_i, l_i = _attend_tiles(
        acc, acc_odd, m_i, l_i, q, q_odd, K, V, KScale, VScale, BlockTable, seq, kv_head, q_pos, unmasked_hi, hi,
        k_start, sm_scale_log2, window_left, window_right, stride_kt, stride_kh, stride_kb, stride_vt, stride_vh,
        stride_vb, stride_bt, num_kv_heads, d, d_ok, tree_bits, first_new, BLOCK_M, BLOCK_N, PAGED, PAGE_SIZE,
        CAUSAL, True, TMA, UPCAST, KV_SCALES, TREE, PAIRS, INTERPRET)

    if PAIRS:
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, BLOCK_D])
    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    if NUM_SPLITS == 1:
        tl.store(Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # this split's normalised result and its log-sum-exp, merged by _merge_splits
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        t = q_start + tok
        tl.store(PartOut + split * stride_ps + t[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :],
                 out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(PartLse + split * stride_ls + t * stride_lt + head, lse, mask=row_ok)


# (the number of sequences and the block table's row stride vary from step to step in eager steps, and Triton would
# compile a kernel for each of 1 / a multiple of 16 / other. A multiple of 16 compiles to the same SASS as other
# counts, by instruction counts, so only 1 stays specialized: it is worth 1.2 us of a 25 us FP8 decode at 1 x 32k,
# and the engine's warm-up compiles it, docs/kernel-notes.md)
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["num_seqs"])
def _attention_kernel(
    Q, K, V, KScale, VScale, Out, PartOut, PartLse,
    CuSeqlensQ, CuSeqlensK, SeqLensK, BlockTable, TreeMask,
    num_seqs, sm_scale_log2, window_left, window_right, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_kb, stride_vt, stride_vh, stride_vb, stride_ot, stride_oh,
    stride_bt, stride_bth, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MASK_EVERY_TILE: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr, KV_SCALES: tl.constexpr,
    TREE: tl.constexpr, PAIRS: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)  # the merge (or the next kernel) may launch now and wait on the GPU for this grid
    # Causal row tiles further down see more keys: launch those first so the short ones fill the tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    # Copy-engine decode launches at most one wave of programs (see _launch), each taking every num_programs(1)-th
    # sequence in turn. Prefill and the rest keep one sequence per program: inside the loop they compiled to
    # slower code (docs/kernel-notes.md).
    if TMA:
        for seq in range(tl.program_id(1), num_seqs, tl.num_programs(1)):
            _attend_sequence(seq, pid_m, kv_head, split, Q, K, V, KScale, VScale, Out, PartOut, PartLse, CuSeqlensQ,
                             CuSeqlensK, SeqLensK, BlockTable, TreeMask, sm_scale_log2, window_left, window_right,
                             num_kv_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_kb, stride_vt,
                             stride_vh, stride_vb, stride_ot, stride_oh, stride_bt, stride_bth, stride_ps, stride_pt,
                             stride_ph, stride_ls, stride_lt, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGED,
                             PAGE_SIZE, CAUSAL, NUM_SPLITS, MASK_EVERY_TILE, TMA, UPCAST, KV_SCALES, TREE, PAIRS,
                             INTERPRET)
    else:
        _attend_sequence(tl.program_id(1), pid_m, kv_head, split, Q, K, V, KScale, VScale, Out, PartOut, PartLse,
                         CuSeqlensQ, CuSeqlensK, SeqLensK, BlockTable, TreeMask, sm_scale_log2, window_left, window_right,
                         num_kv_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_kb, stride_vt, stride_vh,
                         stride_vb, stride_ot, stride_oh, stride_bt, stride_bth, stride_ps, stride_pt, stride_ph,
                         stride_ls, stride_lt, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGED, PAGE_SIZE, CAUSAL,
                         NUM_SPLITS, MASK_EVERY_TILE, TMA, UPCAST, KV_SCALES, TREE, PAIRS, INTERPRET)


@triton.jit
def _merge_splits(PartOut, PartLse, Out, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
                  NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  PDL: tl.constexpr):
    """out = sum_s exp2(lse_s - max) * part_s / sum_s exp2(lse_s - max), one program per (token, head, BLOCK_D
    columns of the head)."""
    wait_for_previous(PDL)  # launched early: wait here until the split programs' writes are done
    release_next(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    lse = tl.load(PartLse + s * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    part = tl.load(PartOut + s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                   mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


_LOG2E = 1.4426950408889634


@functools.lru_cache
def _before_hopper(device: torch.device) -> bool:
    """A CUDA GPU older than sm_90. CPU tensors are not: the interpreter models the copy engine, and the compile-only
    check (tests/compile_for_hopper.py) builds for an H100. Cached: it is asked on every launch."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9


def _copy_engine_can_read(cache: torch.Tensor) -> bool:
    """Whether Hopper's tensor copy engine (TMA) can fetch [tile, D] boxes of one KV head from this cache, viewed
    as [blocks * block_size, Hkv * D]: rows of contiguous heads, 16-byte aligned; the interpreter models it too."""
    _, page, _, dim = cache.shape
    if _before_hopper(cache.device):
        return False
    return (cache.stride(3) == 1 and cache.stride(2) == dim and cache.stride(0) == page * cache.stride(1)
            and dim & (dim - 1) == 0 and (cache.stride(1) * cache.element_size()) % 16 == 0
            and cache.data_ptr() % 16 == 0 and dim * cache.element_size() >= 16)


def cache_descriptor(cache: torch.Tensor, rows: int) -> TensorDescriptor:
    """A paged cache [blocks, block_size, Hkv, D] as the copy engine reads it: [slots, Hkv * D], in [rows, D] boxes
    (rows keys of one KV head)."""
    blocks, page, hkv, dim = cache.shape
    return TensorDescriptor(cache, [blocks * page, hkv * dim], [cache.stride(1), 1], [rows, dim])


def _check(q, k_or_cache, v_or_cache, window_size):
    if q.dim() != 3 or k_or_cache.shape != v_or_cache.shape:
        raise ValueError("q must be [tokens, heads, head_dim] and k/v must have equal shapes")
    if q.shape[1] % k_or_cache.shape[-2]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_or_cache.shape[-2]})")
    if q.shape[-1] != k_or_cache.shape[-1] or 1 != q.stride(-1) or 1 != k_or_cache.stride(-1) or 1 != v_or_cache.stride(-1):
        raise ValueError("head_dim must match and be the innermost, contiguous dimension")
    if len(window_size) != 2:
        raise ValueError("window_size must be (left, right)")


def _tiles(head_dim: int, max_seqlen_q: int, group: int, tma: bool, page: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this shape; chosen by sweeps (bench --sweep) on an H200, and
    on an H100 for the copy-engine decode."""
    if max_seqlen_q * group <= 16 and tma:  # decode through the copy engine: 16 keys a tile, whatever the page
        return 16, 16, 1, 5  # (a tile of a whole page of 32 or 64 keys was up to 36% slower: docs/kernel-notes.md)
    if max_seqlen_q * group <= 16:  # gathered decode (pages of 8 keys, GPUs before Hopper): few rows, stream keys
        return 16, 64 if head_dim <= 128 else 32, 4, 2
    if head_dim <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 2


def _invariant_tiles(head_dim: int) -> tuple[int, int, int, int]:
    """The batch-invariant mode's tiles, for every shape."""
    return (64, 64, 4, 3) if head_dim <= 128 else (64, 32, 4, 2)


def _sm_scale_log2(softmax_scale: float | None, head_dim: int) -> float:
    """The softmax's scale times log2(e): the kernels exponentiate in base 2."""
    return (softmax_scale if softmax_scale is not None else head_dim**-0.5) * _LOG2E


def _launch(q, k, v, out, cu_q, cu_k, seq_lens_k, block_table, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
            window_size, num_splits, paged: bool, page_size: int, tiles=None, batch_invariant: bool = False,
            scales=None, tree_mask=None):
    """`max_seqlen_k`: None for a paged cache. `scales`: a quantized cache's (k_scale, v_scale), per KV head (FP8)
    or per slot and KV head (INT8). `tree_mask`: per query row, the bits of its sequence's queries it sees
    (paged_attention)."""
    total_q, hq, dim = q.shape
    hkv = k.shape[-2]
    group = hq // hkv
    batch = cu_q.numel() - 1
    if total_q == 0 or batch == 0:
        return out
    scale = _sm_scale_log2(softmax_scale, dim)
    interpret = interpreting()
    if (tiles is None and not batch_invariant and tree_mask is None
            and num_splits == 1 and max_seqlen_q * group > 16 and not interpret
            and hopper_prefill.serves(q, k, v, page_size if paged else None)):
        return hopper_prefill.prefill(q, k, v, out, cu_q, cu_k, seq_lens_k, block_table if paged else None,
                                      max_seqlen_q, max_seqlen_k, causal=causal, sm_scale_log2=scale,
                                      window_size=window_size, cache_scales=scales)
    # Decode reads pages through the copy engine: each program keeps several pages in flight. Its tiles are at most
    # one page, and a tile feeds tl.dot, which needs 16 keys or more.
    tma = (not batch_invariant and paged and max_seqlen_q * group <= 16 and page_size >= 16
           and _copy_engine_can_read(k) and _copy_engine_can_read(v))
    block_m, block_n, warps, stages = (_invariant_tiles(dim) if batch_invariant else
                                       tiles or _tiles(dim, max_seqlen_q, group, tma, page_size))
    block_d = triton.next_power_of_2(dim)
    grid_m = triton.cdiv(max_seqlen_q * group, block_m)
    decode = block_m == 16
    kv_strides = (k.stride(-3), k.stride(-2), k.stride(0) if paged else 0,
                  v.stride(-3), v.stride(-2), v.stride(0) if paged else 0)
    pairs = tma and k.element_size() == 1  # an 8-bit cache's tiles come as 16-bit words (_byte_pairs)
    if pairs:
        k, v = k.view(torch.int16), v.view(torch.int16)
        kv_strides = (k.stride(-3), k.stride(-2), k.stride(0), v.stride(-3), v.stride(-2), v.stride(0))
    if tma:
        assert page_size % block_n == 0, "a copy-engine tile must lie inside one page"
        k, v = (cache_descriptor(c, block_n) for c in (k, v))
    # Programmatic dependent launch (flashpage.kernels.pdl): the merge is launched while the split programs run and
    # waits for their writes on the GPU, which takes its launch off the critical path.
    launch_pdl = pdl.enabled(q.device)
    # Gather decode masks every tile (a second loop cost more than the masking); the copy-engine decode keeps the
    # unmasked loop, where its V tiles go straight from shared memory to the tensor cores.
    # Batch-invariant: every tile masked too, as the compiler fuses the unmasked tiles' arithmetic differently (one
    # rounding fewer), and whether a key tile needs a mask depends on which rows share the program.
    common = dict(MASK_EVERY_TILE=decode and not tma or batch_invariant, TMA=tma, PDL=launch_pdl,
                  launch_pdl=launch_pdl, GROUP=group, HEAD_DIM=dim, BLOCK_D=block_d,
                  BLOCK_M=block_m, BLOCK_N=block_n, PAGED=paged, PAGE_SIZE=page_size, CAUSAL=causal,
                  NUM_SPLITS=num_splits, num_warps=warps, num_stages=stages,
                  UPCAST=q.dtype == torch.bfloat16 and interpret,
                  KV_SCALES=0 if scales is None else 2 if scales[0].dim() == 3 else 1, TREE=tree_mask is not None,
                  PAIRS=pairs, INTERPRET=interpret)
    if num_splits == 1:  # the kernel normalises and writes `out` itself
        part, lse, part_strides = out, out, (0, 0, 0, 0, 0)
    else:
        part = torch.empty((num_splits, total_q, hq, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, total_q, hq), dtype=torch.float32, device=q.device)
        part_strides = (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    seq_programs = batch
    if tma:  # programs beyond one wave would run as a partial second wave: loop over sequences instead
        rounds = triton.cdiv(batch * hkv * num_splits, _programs_per_wave(q.device))
        seq_programs = triton.cdiv(batch, rounds)
    unused = cu_q  # stands in for the pointers the variant does not read
    _attention_kernel[(grid_m, seq_programs, hkv * num_splits)](
        q, k, v, *(scales or (unused, unused)), out, part, lse, cu_q, unused if paged else cu_k,
        seq_lens_k if paged else unused, block_table if paged else unused,
        unused if tree_mask is None else tree_mask, batch, scale, window_size[0],
        window_size[1], hkv,
        q.stride(0), q.stride(1), *kv_strides, out.stride(0), out.stride(1),
        block_table.stride(0) if paged else 0, head_stride(block_table) if paged else 0, *part_strides,
        **common)
    if num_splits > 1:
        # One warp per 32 columns of a head: a merge of many small programs finishes sooner after the last split
        # than one 4-warp program per head (docs/kernel-notes.md).
        merge_d = min(block_d, 32)
        _merge_splits[(total_q, hq, triton.cdiv(dim, merge_d))](
            part, lse, out, *part_strides, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=dim, BLOCK_D=merge_d, PDL=launch_pdl,
            launch_pdl=launch_pdl, num_warps=1)
    return out


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=True,
                      softmax_scale=None, window_size=(-1, -1), tiles=None, batch_invariant=False, out=None,
                      fp8=False):
    """Attention over packed variable-length sequences. q [total_q, Hq, D], k/v [total_k, Hkv, D]. `tiles`
    (BLOCK_M, BLOCK_N, num_warps, num_stages) runs this module's kernel with that tile shape, never the Hopper
    prefill (benchmark sweeps and comparisons). batch_invariant=True:
    a query row's result does not depend on the other rows and sequences of the call (one tile shape, every
    tile masked). fp8=True (opt-in, lossy; its error is in README): q, k and v quantized to e4m3 with one scale
    per head; a Hopper GPU multiplies them on FP8 tensor cores (`hopper_prefill.prefill_fp8`), elsewhere their
    dequantized values go through this module's kernel."""
    _check(q, k, v, window_size)
    out = torch.empty_like(q) if out is None else out
    if fp8:
        if tiles is not None or batch_invariant:
            raise ValueError("fp8 attention takes neither tiles nor batch_invariant")
        if not interpreting() and hopper_prefill.serves(q, k, v, None):
            return hopper_prefill.prefill_fp8(hopper_prefill.quantize_inputs(q, k, v, cu_seqlens_k), out, cu_seqlens_q,
                                              max_seqlen_q, max_seqlen_k, causal=causal,
                                              sm_scale_log2=_sm_scale_log2(softmax_scale, q.shape[-1]),
                                              window_size=window_size)
        q, k, v = (dequantize_heads(*quantize_heads(t), q.dtype) for t in (q, k, v))
    return _launch(q, k, v, out, cu_seqlens_q, cu_seqlens_k, None, None, max_seqlen_q, max_seqlen_k, causal,
                   softmax_scale, window_size, 1, paged=False, page_size=1, tiles=tiles,
                   batch_invariant=batch_invariant)


def paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, *, causal=True,
                    softmax_scale=None, window_size=(-1, -1), num_splits=None, tiles=None, batch_invariant=False,
                    out=None, query_mask=None):
    """Queries are the last q_len tokens of sequences whose keys sit in a paged cache (a KVCache: k/v
    [blocks, block_size, Hkv, D]). `query_mask`: the queries form token trees (`flashpage.kernels.tree`).

    Decode (max_seqlen_q == 1) splits long key ranges over several programs when the batch alone cannot fill
    the GPU (Flash-Decoding); `num_splits` overrides that choice, and `tiles` (BLOCK_M, BLOCK_N, num_warps,
    num_stages) runs this module's kernel with that tile shape, never the Hopper prefill (benchmark sweeps). batch_invariant=True: a query row's result does not depend on
    the other rows and sequences of the call, decode or prefill (one tile shape, no split, no copy engine, every
    tile masked).
    """
    k_cache, v_cache = kv_cache.k, kv_cache.v
    _check(q, k_cache, v_cache, window_size)
    page = k_cache.shape[1]
    if page < 8 or page & (page - 1):
        raise ValueError(f"block size must be a power of two >= 8, got {page}")
    if query_mask is not None:
        check_query_mask(query_mask, q, causal, window_size)
    if batch_invariant:
        num_splits = 1
    elif num_splits is None:
        num_splits = choose_num_splits(cu_seqlens_q.numel() - 1, k_cache.shape[2], max_seqlen_q,
                                       block_table.shape[-1] * page, q.device, k_cache.element_size())
    elif num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    out = torch.empty_like(q) if out is None else out
    scales = None if kv_cache.k_scale is None else (kv_cache.k_scale, kv_cache.v_scale)
    return _launch(q, k_cache, v_cache, out, cu_seqlens_q, None, seq_lens_k, block_table, max_seqlen_q, None,
                   causal, softmax_scale, window_size, num_splits, paged=True, page_size=page, tiles=tiles,
                   batch_invariant=batch_invariant, scales=scales, tree_mask=query_mask)


def choose_num_splits(batch: int, kv_heads: int, max_seqlen_q: int, max_seqlen_k: int, device,
                      cache_bytes: int = 2) -> int:
    """Split-KV decode: about four programs per SM over the whole grid (batch x KV heads x splits), so every SM
    streams an equal share, each split keeping at least 32 keys (two pages of 16); at most 128 splits (the merge
    holds them all). One program streams a few hundred GB/s at best: few long programs leave most of the bandwidth
    unused, and at short contexts the time is one program's chain of page loads. An 8-bit cache (`cache_bytes` 1)
    gets eight programs per SM: its tiles carry half the bytes, so each program streams half as fast (measured on
    an H100, docs/kernel-notes.md)."""
    if max_seqlen_q > 1 or device.type != "cuda":
        return 1
    sms = sm_count(device)
    per_sm = 8 if cache_bytes == 1 else 4
    return max(1, min(round(per_sm * sms / max(batch * kv_heads, 1)), max_seqlen_k // 32, 128))


def _programs_per_wave(device: torch.device) -> int:
    """Copy-engine decode programs that run at once: each takes 24.6 KB of shared memory, so 9 fit on a Hopper SM;
    8 per SM leaves room; a partial second wave cost more than each program taking two sequences
    (docs/kernel-notes.md); an 8-bit cache's programs, with half the shared memory, measured no faster at 12 or 16
    per SM. Unbounded for CPU tensors: the interpreter runs programs in turn."""
    if device.type != "cuda":
        return 1 << 30
    return 8 * sm_count(device)
