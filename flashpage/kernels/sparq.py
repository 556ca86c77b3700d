"""SparQ attention for decode (Ribar et al., 2024) in Triton, and the cache extras it reads.

The algorithm and its PyTorch reference are `reference.sparq_attention`; here it runs as five steps, each a plain
pass over memory, so that a step reads r / head_dim of the keys, k whole keys and values, and one running value
sum, instead of every key and value:
1. `_approximate_scores` chooses the r components of each (sequence, KV head), the largest of |q| summed over the
   group (`tl.topk`, in every program: 128 values),
2. and those components of every key, from the component-major copy `k_t` (e4m3: one run of block_size bytes
   per component and page, 64 by default with SparQ; or in 4 bits, half the bytes and a scale per key), give
   each head's approximate scores (kept, a key's heads side by side) and, per split of the keys, their running
   max and sum (and zero the select's histograms);
3. `_aggregate`: each key's approximate probability summed over the group's heads (infinity for the last `recent`
   keys, so that they are chosen), and the first digits of the top-k's radix select counted as they are written;
   `top_k_positions` (`kernels/topk.py`) picks k keys. For a 16-bit cache the kept scores and the summed
   probabilities are fp16: half the bytes, and ranked by their exponent alone, one 5-bit digit, so that the
   select is a single launch, its write (sums within a factor of two of each other tie, the first positions
   taken). Ranking in fp16 can swap keys tied within its rounding; on SmolLM2's own activations that moved the
   output 0.2% (median) against SparQ's 21% from dense attention; the exponent's perplexity on SmolLM2 was within
   0.2 points of the full fp16 ranking's with the last keys always chosen, 0.4-0.9 points above it in the paper's
   form (docs/kernel-notes.md);
4. `_attend_chosen`: exact attention over the chosen keys, gathered row by row from the paged cache (Flash-
   Decoding splits over the chosen keys), and alpha, the approximate probability they hold;
5. `_combine`: alpha * attention + (1 - alpha) * mean value (the last block's running sum / keys), per query
   head.
With value axes (`v_t`, the values' coordinates along them) the unchosen keys' share goes to their own values
along those axes: step 3 also sums each head's approximate probability times the coordinates over its keys (a
key's M bytes read as whole words), step 4 the chosen keys' share, and step 5 adds the axes times the difference,
less (1 - alpha) times the mean value's coordinates.
Decode only: one query per sequence. Steps 1 and 2 see the keys turned by the cache's `sparq_basis` (`k_t` is
written so) and the queries by its `sparq_query_basis` (`_turn_queries`, first); steps 4 and 5 the keys as they
are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels import topk
from flashpage.kernels.attention import tile_dot
from flashpage.kernels.device import interpreting, sm_count
from flashpage.kernels.quantize import to_e4m3
from flashpage.kernels.topk import count_first_digits, digit_counts, top_k_positions

_LOG2E = 1.4426950408889634
_INTERPRET = tl.constexpr(interpreting())
AGGREGATE_KEYS = 1024  # keys per aggregation program
TAIL_ROWS = 64  # the aggregation programs' sums of the tail that the combine adds at a time
# fp16 sums rank by their exponent alone (within a factor of two a tie, taken first position first): one radix
# digit, which the aggregation counts, and the select's one launch is its write (docs/kernel-notes.md)
FP16_DROP_BITS = 10
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # integers of so many bytes


@triton.jit
def _turn_queries(Q, Basis, Out, num_heads, stride_qb, stride_qh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """A sequence's query heads of one KV head turned by that head's Basis [Hkv, D, D] (the queries' turn), into
    Out [B, Hq, D], rounded to their dtype as the reference's product is. Once per (sequence, KV head), not in every
    program of the scores: those are one warp each, and the basis is 32 KB."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    heads = h * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows = (g < GROUP)[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=rows, other=0.0)
    turn = tl.load(Basis + h * HEAD_DIM * HEAD_DIM + d[:, None] * HEAD_DIM + d[None, :],
                   mask=d_ok[:, None] & d_ok[None, :], other=0.0)
    q = tile_dot(q, turn, UPCAST)
    tl.store(Out + (b * num_heads + heads[:, None]) * HEAD_DIM + d[None, :], q.to(Out.dtype.element_ty), mask=rows)


@triton.jit
def _tile_pages(BlockTable, b, stride_bt, start, hi, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The cache blocks of the tile of keys from `start` (a multiple of PAGE_SIZE), and which of them hold keys."""
    page = start // PAGE_SIZE + tl.arange(0, BLOCK_N // PAGE_SIZE)
    page_ok = page * PAGE_SIZE < hi
    return tl.load(BlockTable + b * stride_bt + page, mask=page_ok, other=0).to(tl.int64), page_ok


@triton.jit
def _copy_tile(KT, block, page_ok, kt_rows, j_ok, stride_block, stride_tok, PAGE_SIZE: tl.constexpr,
               KEY_BITS: tl.constexpr):
    """The chosen components of a tile's keys, [BLOCK_R, pages, run]: each page read whole, since a component's
    keys of one page are a run of contiguous values (PAGE_SIZE, or in 4 bits PAGE_SIZE / 2 bytes of two keys each),
    which the compiler loads as vectors only where it sees them as [.., run] under one mask (keys past the end are
    masked in the scores)."""
    t = tl.arange(0, PAGE_SIZE * KEY_BITS // 8)
    return tl.load(KT + block[None, :, None] * stride_block + kt_rows[:, None, None] + t[None, None, :] * stride_tok,
                   mask=j_ok[:, None, None] & page_ok[None, :, None], other=0.0)


@triton.jit
def _widen_codes(codes):
    """A 4-bit copy's codes [.., n] (a byte's low nibble one key's, its high nibble another's) as two fp16 tiles:
    1024 + c for the low nibbles' codes c, 1024 + 16 c for the high ones', exact: each nibble or-ed into the bits of
    1024, two codes a logical operation (`reference.int4_keys`; the scores take the offsets off after the
    product)."""
    if _INTERPRET:  # (it runs no PTX)
        low = (1024 + (codes & 15).to(tl.int32)).to(tl.float16)
        high = (1024 + (codes & 0xF0).to(tl.int32)).to(tl.float16)
    else:  # four bytes a word: each pair's bytes spread to the word's halves, then masked into 1024's bits
        low, high = tl.inline_asm_elementwise(
            asm="""{ .reg .b32 pair01, pair23;
            prmt.b32 pair01, $4, $4, 0x1100;
            prmt.b32 pair23, $4, $4, 0x3322;
            lop3.b32 $0, pair01, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 $1, pair23, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 $2, pair01, 0x00F000F0, 0x64006400, 0xEA;
            lop3.b32 $3, pair23, 0x00F000F0, 0x64006400, 0xEA; }""",
            constraints="=r,=r,=r,=r,r", args=[codes], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return low, high


@triton.jit
def _part_keys(start, part: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KEY_BITS: tl.constexpr):
    """The positions of a tile's keys: the tile's, or in 4 bits each page's first half (part 0, the low nibbles) or
    second half."""
    run: tl.constexpr = PAGE_SIZE * KEY_BITS // 8
    i = tl.arange(0, BLOCK_N * KEY_BITS // 8)
    return start + (i // run) * PAGE_SIZE + part * run + i % run


@triton.jit
def _key_scales(KTScale, block, page_ok, h, part: tl.constexpr, stride_sblock, stride_shead, PAGE_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, KEY_BITS: tl.constexpr):
    """A 4-bit copy's scales of the keys of a tile's low nibbles (part 0) or high ones (part 1), [BLOCK_N / 2]
    float32, the latter over 16 (`_widen_codes`; ones for e4m3)."""
    if KEY_BITS == 8:
        scales = tl.full([BLOCK_N // 2], 1.0, dtype=tl.float32)
    else:
        t = part * (PAGE_SIZE // 2) + tl.arange(0, PAGE_SIZE // 2)
        scales = tl.load(KTScale + block[:, None] * stride_sblock + h * stride_shead + t[None, :],
                         mask=page_ok[:, None], other=0.0)
        scales = tl.reshape(scales.to(tl.float32), [BLOCK_N // 2]) * (1.0 / 16.0 if part else 1.0)
    return scales


@triton.jit
def _approximate_scores(Q, KT, KTScale, BlockTable, SeqLens, Logits, PartM, PartL, Digits, sm_scale_log2,
                        num_kv_heads, stride_qb, stride_qh, stride_bt, stride_lb, stride_lh, stride_block, stride_head,
                        stride_comp, stride_tok, stride_sblock, stride_shead, GROUP: tl.constexpr,
                        GROUP_PAD: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        UPCAST: tl.constexpr, DIGIT_CELLS: tl.constexpr, BLOCK_DC: tl.constexpr,
                        KEY_BITS: tl.constexpr):
    """Tiles of BLOCK_N keys by the group's heads (the keys are the product's rows, so the scores come out as
    Logits holds them, a key's heads side by side, and the padding of the group to a power of two is all the
    tensor cores compute beyond it). KT is the component-major copy (stride_tok 1; in KEY_BITS 4, two keys a byte,
    with KTScale, each key's scale), or the cache's K itself (strided reads, for comparison). Each (sequence, KV
    head)'s first split also zeroes its row of the select's histograms (DIGIT_CELLS of them; 0: none), which the
    aggregation fills next: a launch of its own cost more than the store."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    if DIGIT_CELLS > 0:
        if split == 0:
            c = tl.arange(0, BLOCK_DC)
            tl.store(Digits + (b * num_kv_heads + h) * DIGIT_CELLS + c, tl.zeros([BLOCK_DC], dtype=tl.int32),
                     mask=c < DIGIT_CELLS)
    n_keys = tl.load(SeqLens + b)
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    heads = h * GROUP + g
    d = tl.arange(0, BLOCK_D)
    q_rows = Q + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=g_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
    # the R components where |q| summed over the group is largest: the sums' bits (non-negative floats order as
    # their bits do) above each component's index (ties to the lower one), the top BLOCK_R of them, largest first
    weight = tl.sum(tl.abs(q), 0).to(tl.int32, bitcast=True).to(tl.int64)
    packed = tl.where(d < HEAD_DIM, (weight << 32) | (BLOCK_D - 1 - d), -1)
    comp = (BLOCK_D - 1 - (tl.topk(packed, BLOCK_R) & 0xFFFFFFFF)).to(tl.int32)
    j_ok = tl.arange(0, BLOCK_R) < R
    q_hat = tl.load(q_rows + comp[None, :], mask=g_ok[:, None] & j_ok[None, :], other=0.0)
    # each head's temperature: the share of its |q| that the chosen components carry
    frac = tl.sum(tl.abs(q_hat.to(tl.float32)), 1) / tl.maximum(tl.sum(tl.abs(q), 1), 1e-30)
    scale = sm_scale_log2 / tl.sqrt(tl.maximum(frac, 1e-30))
    if q_hat.dtype == tl.float32 or KT.dtype.element_ty == tl.float32:  # (a float32 cache, or `strided` on one)
        q_hat_t = tl.trans(q_hat.to(tl.float32))  # [BLOCK_R, GROUP_PAD]
    else:  # e4m3 (the copy) converts to fp16 exactly; bf16 queries do too, within fp16's range
        q_hat_t = tl.trans(q_hat.to(tl.float16))
    if KEY_BITS == 4:  # what a 4-bit copy's offset adds to each key's product, per unit of offset
        q_sum = tl.sum(q_hat_t.to(tl.float32), 0)

    tiles = tl.cdiv(n_keys, BLOCK_N)
    lo = (split * tiles // NUM_SPLITS) * BLOCK_N
    hi = tl.minimum(n_keys, ((split + 1) * tiles // NUM_SPLITS) * BLOCK_N)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    kt_rows = h * stride_head + comp.to(tl.int64) * stride_comp  # within a block
    # loads run ahead of their use (the block numbers two tiles, the keys one), so that no load in the loop waits
    # for another: a warp's tile is small, and a load that waited on its block number paid two latencies
    block, page_ok = _tile_pages(BlockTable, b, stride_bt, lo, hi, BLOCK_N, PAGE_SIZE)
    kt = _copy_tile(KT, block, page_ok, kt_rows, j_ok, stride_block, stride_tok, PAGE_SIZE, KEY_BITS)
    ks0 = _key_scales(KTScale, block, page_ok, h, 0, stride_sblock, stride_shead, PAGE_SIZE, BLOCK_N, KEY_BITS)
    ks1 = _key_scales(KTScale, block, page_ok, h, 1, stride_sblock, stride_shead, PAGE_SIZE, BLOCK_N, KEY_BITS)
    block, page_ok = _tile_pages(BlockTable, b, stride_bt, lo + BLOCK_N, hi, BLOCK_N, PAGE_SIZE)
    for start in range(lo, hi, BLOCK_N):
        kt_next = _copy_tile(KT, block, page_ok, kt_rows, j_ok, stride_block, stride_tok, PAGE_SIZE, KEY_BITS)
        ks0_next = _key_scales(KTScale, block, page_ok, h, 0, stride_sblock, stride_shead, PAGE_SIZE, BLOCK_N,
                               KEY_BITS)
        ks1_next = _key_scales(KTScale, block, page_ok, h, 1, stride_sblock, stride_shead, PAGE_SIZE, BLOCK_N,
                               KEY_BITS)
        block, page_ok = _tile_pages(BlockTable, b, stride_bt, start + 2 * BLOCK_N, hi, BLOCK_N, PAGE_SIZE)
        if KEY_BITS == 8:
            keys_low = tl.reshape(kt, [BLOCK_R, BLOCK_N])
            keys_high = keys_low  # (no such part)
        else:
            keys_low, keys_high = _widen_codes(tl.reshape(kt, [BLOCK_R, BLOCK_N // 2]))
        for part in tl.static_range(8 // KEY_BITS):  # (4 bits: the keys of the low nibbles, then of the high ones)
            k_hat = tl.trans(keys_high if part else keys_low).to(q_hat_t.dtype)
            offset = 1152.0 if part else 1032.0  # (a 4-bit copy's: 1024 + 8, or 1024 + 16 * 8)
            if KEY_BITS == 4 and q_hat_t.dtype == tl.float32:  # taken off each key: in float32 that is exact,
                k_hat = k_hat - offset  # where the product's offset would cost 1e-5 of the output (tests only)
            s = tile_dot(k_hat, q_hat_t, UPCAST)  # [keys, GROUP_PAD]
            if KEY_BITS == 4:  # the offset off the 16-bit product (exact to about 1e-5), then each key's scale
                if q_hat_t.dtype != tl.float32:
                    s = s - offset * q_sum[None, :]
                s = s * (ks1 if part else ks0)[:, None]
            s = s * scale[None, :]  # base 2
            n = _part_keys(start, part, PAGE_SIZE, BLOCK_N, KEY_BITS)
            ok = n < hi
            s = tl.where(ok[:, None], s, float("-inf"))
            tl.store(Logits + b * stride_lb + h * stride_lh + n[:, None] * GROUP + g[None, :],
                     s.to(Logits.dtype.element_ty), mask=ok[:, None] & g_ok[None, :])
            m_new = tl.maximum(m_i, tl.max(s, 0))
            p = tl.exp2(s - m_new[None, :])
            rescale = tl.exp2(m_i - m_new)
            l_i = l_i * rescale + tl.sum(p, 0)
            m_i = m_new
        kt, ks0, ks1 = kt_next, ks0_next, ks1_next
    part = (b * num_kv_heads * GROUP + heads) * NUM_SPLITS + split
    tl.store(PartM + part, m_i, mask=g_ok)
    tl.store(PartL + part, l_i, mask=g_ok)


@triton.jit
def _log_sum_exp(PartM, PartL, b, heads, g_ok, num_kv_heads, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    """Each head's log2-sum-exp2 of its approximate scores, from the splits' running max and sum."""
    s = tl.arange(0, BLOCK_S)
    at = ((b * num_kv_heads * GROUP + heads) * NUM_SPLITS)[:, None] + s[None, :]
    ok = g_ok[:, None] & (s[None, :] < NUM_SPLITS)
    m = tl.load(PartM + at, mask=ok, other=float("-inf"))
    l_ = tl.load(PartL + at, mask=ok, other=0.0)
    top = tl.max(m, 1)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, l_ * tl.exp2(m - top_safe[:, None])), 1)
    return top_safe + tl.log2(tl.maximum(total, 1e-30))


@triton.jit
def _byte_as_e4m3(word, j):
    """Byte j of each word (integer tensors) as the e4m3 value it holds, in float32."""
    return ((word >> (8 * j)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _aggregate(Logits, PartM, PartL, SeqLens, Agg, Lse, BlockTable, VTWords, PartTail, Digits, ChunkDigits,
               ChunkAbove, num_kv_heads, max_keys, recent, stride_lb, stride_lh, stride_ab, stride_ah, stride_bt,
               stride_vblock, stride_vhead, stride_vtok,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK: tl.constexpr, LEVELS: tl.constexpr, KEY_BITS: tl.constexpr, DROP_BITS: tl.constexpr,
               PAGE_SIZE: tl.constexpr, AXES: tl.constexpr, WORD: tl.constexpr):
    """Each key's approximate probability summed over the group's heads (-1 past the sequence's end, infinity for
    its last `recent` keys), and the top-k select's first digits of them (LEVELS of digits, 0 where the select
    needs none; with one, also this program's own counts, ChunkDigits and ChunkAbove); with AXES, each head's sum
    over this program's keys of approximate probability times the values' coordinates (PartTail, one row per
    program: the combine sums them), from VTWords, the copy `v_t` viewed as words of WORD bytes."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    chunk = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    heads = h * GROUP + g
    lse = _log_sum_exp(PartM, PartL, b, heads, g_ok, num_kv_heads, GROUP, NUM_SPLITS, BLOCK_S)
    if chunk == 0:
        tl.store(Lse + b * num_kv_heads * GROUP + heads, lse, mask=g_ok)
    n = chunk * BLOCK + tl.arange(0, BLOCK)
    n_keys = tl.load(SeqLens + b)
    ok = n < n_keys
    logits = Logits + b * stride_lb + h * stride_lh
    s = tl.load(logits + n[None, :] * GROUP + g[:, None], mask=g_ok[:, None] & ok[None, :], other=float("-inf"))
    p = tl.exp2(s - lse[:, None])  # [heads, keys]
    agg = tl.where(ok, tl.sum(p, 0), -1.0)
    agg = tl.where(ok & (n >= n_keys - recent), float("inf"), agg).to(Agg.dtype.element_ty)
    tl.store(Agg + b * stride_ab + h * stride_ah + n, agg, mask=n < max_keys)
    if LEVELS > 0:
        count_first_digits(Digits, ChunkDigits, ChunkAbove, b * num_kv_heads + h, chunk, tl.num_programs(2), agg,
                           n < max_keys, LEVELS, KEY_BITS, DROP_BITS)
    if AXES > 0:  # a key's coordinates are one run of AXES bytes; past the end the copy may hold NaNs: masked
        block = tl.load(BlockTable + b * stride_bt + n // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        words = VTWords + (block * stride_vblock + h * stride_vhead + (n % PAGE_SIZE) * stride_vtok) // WORD
        rows = (b * num_kv_heads * GROUP + heads) * tl.num_programs(2) + chunk
        for w in tl.static_range(AXES // WORD):  # a key's coordinates as words of WORD bytes: loads a key apart
            word = tl.load(words + w, mask=ok, other=0)
            # [heads, keys] as p is laid out: the word moves between the load's layout and p's once, not each byte
            word = tl.where(g_ok[:, None], word[None, :], 0)
            for j in tl.static_range(WORD):  # each axis: the heads' sums over this program's keys
                c = _byte_as_e4m3(word, j)
                tl.store(PartTail + rows * AXES + w * WORD + j, tl.sum(p * c, 1), mask=g_ok)


@triton.jit
def _chosen_tile(Chosen, BlockTable, b, h, n_keys, start, hi, stride_xb, stride_xh, stride_bt, BLOCK_N: tl.constexpr,
                 PAGE_SIZE: tl.constexpr):
    """The chosen places from `start` (int64 in Chosen), which of them are keys, and their cache blocks."""
    i = start + tl.arange(0, BLOCK_N)
    key = tl.load(Chosen + b * stride_xb + h * stride_xh + i, mask=i < hi, other=0).to(tl.int32)
    ok = (i < hi) & (key < n_keys)  # a sequence shorter than k chose some places past its end
    block = tl.load(BlockTable + b * stride_bt + key // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    return key, ok, block


@triton.jit
def _attend_chosen(Q, KCache, VCache, VTWords, Chosen, Logits, Lse, BlockTable, SeqLens, PartOut, PartLse, PartAlpha,
                   PartChosenC, sm_scale_log2, num_kv_heads, num_chosen, stride_qb, stride_qh, stride_ct, stride_ch,
                   stride_cb, stride_bt, stride_lb, stride_lh, stride_xb, stride_xh, stride_vblock, stride_vhead,
                   stride_vtok, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, AXES: tl.constexpr, BLOCK_A: tl.constexpr, WORD: tl.constexpr,
                   UPCAST: tl.constexpr):
    """Online softmax over this split's share of the chosen keys; rows are the group's heads. Beside it alpha, the
    chosen keys' approximate probability, and with AXES their share of the tail (PartChosenC). Those two are
    summed over keys once, after the loop: each tile only adds its terms to per-key sums (the group's GROUP_PAD
    rows, not the tensor cores' BLOCK_M), so the loop has no reductions across threads for them."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n_keys = tl.load(SeqLens + b)
    g = tl.arange(0, BLOCK_M)
    g_ok = g < GROUP
    heads = h * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)
    g_hat = tl.arange(0, GROUP_PAD)
    g_hat_ok = g_hat < GROUP
    lse = tl.load(Lse + b * num_kv_heads * GROUP + h * GROUP + g_hat, mask=g_hat_ok, other=0.0)
    tiles = tl.cdiv(num_chosen, BLOCK_N)
    lo = (split * tiles // NUM_SPLITS) * BLOCK_N
    hi = tl.minimum(num_chosen, ((split + 1) * tiles // NUM_SPLITS) * BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    p_hat_sum = tl.zeros([GROUP_PAD, BLOCK_N], dtype=tl.float32)  # per head and key: alpha before its sum
    if AXES > 0:  # per head, key and axis: the tail's share before its sum
        a = tl.arange(0, BLOCK_A)
        a_ok = a < AXES
        c_sum = tl.zeros([GROUP_PAD, BLOCK_N, BLOCK_A], dtype=tl.float32)
        w_i = tl.arange(0, BLOCK_A // WORD)  # a key's words (AXES // WORD of them)
    # each tile's chosen places and their blocks are read a tile ahead, so that its keys' and values' loads need
    # not wait for them
    key, ok, block = _chosen_tile(Chosen, BlockTable, b, h, n_keys, lo, hi, stride_xb, stride_xh, stride_bt,
                                  BLOCK_N, PAGE_SIZE)
    for start in range(lo, hi, BLOCK_N):
        row = block * stride_cb + (key % PAGE_SIZE) * stride_ct + h * stride_ch
        k = tl.load(KCache + row[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(VCache + row[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        s_hat = tl.load(Logits + b * stride_lb + h * stride_lh + key[None, :] * GROUP + g_hat[:, None],
                        mask=g_hat_ok[:, None] & ok[None, :], other=float("-inf"))
        if AXES > 0:  # a key's coordinates are one run of AXES bytes, read as words of WORD bytes, used last
            words = VTWords + (block * stride_vblock + h * stride_vhead + (key % PAGE_SIZE) * stride_vtok) // WORD
            word = tl.load(words[:, None] + w_i[None, :], mask=ok[:, None] & (w_i < AXES // WORD)[None, :], other=0)
        tile_ok = ok
        key, ok, block = _chosen_tile(Chosen, BlockTable, b, h, n_keys, start + BLOCK_N, hi, stride_xb, stride_xh,
                                      stride_bt, BLOCK_N, PAGE_SIZE)
        s = tile_dot(q, tl.trans(k), UPCAST)
        s = tl.where(tile_ok[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        rescale = tl.exp2(m_i - m_safe)
        l_i = l_i * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tile_dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
        # the approximate probabilities and coordinates, gathered as the tile began, are used only now: their
        # loads' latency passes under the products
        p_hat = tl.exp2(s_hat - lse[:, None])
        p_hat_sum += p_hat
        if AXES > 0:  # [BLOCK_N, BLOCK_A]
            c = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.float32)
            for w in tl.static_range(AXES // WORD):
                word_w = tl.sum(tl.where(w_i[None, :] == w, word, 0), 1)
                in_word = a // WORD == w
                byte = tl.where(in_word, a - w * WORD, 0)
                c = tl.where(in_word[None, :], _byte_as_e4m3(word_w[:, None], byte[None, :]), c)
            c_sum += p_hat[:, :, None] * c[None, :, :]
    part = (b * num_kv_heads * GROUP + heads) * NUM_SPLITS + split
    tl.store(PartOut + part[:, None] * HEAD_DIM + d[None, :], acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None],
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(PartLse + part, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))),
             mask=g_ok)
    part_hat = (b * num_kv_heads * GROUP + h * GROUP + g_hat) * NUM_SPLITS + split
    tl.store(PartAlpha + part_hat, tl.sum(p_hat_sum, 1), mask=g_hat_ok)
    if AXES > 0:
        tl.store(PartChosenC + part_hat[:, None] * AXES + a[None, :], tl.sum(c_sum, 1),
                 mask=g_hat_ok[:, None] & a_ok[None, :])


@triton.jit
def _combine(PartOut, PartLse, PartAlpha, VCumsum, PartTail, PartChosenC, Axes, Rms, BlockTable, SeqLens, Out,
             num_kv_heads, k, num_chunks, stride_bt, stride_ob, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_DF: tl.constexpr, PAGE_SIZE: tl.constexpr, ATTEND_SPLITS: tl.constexpr,
             BLOCK_AS: tl.constexpr, AXES: tl.constexpr, BLOCK_A: tl.constexpr, TAIL_ROWS: tl.constexpr):
    """out = alpha * (the splits' attention, merged) + (1 - alpha) * mean value; alpha = 1 where every key was
    chosen. With AXES, plus Axes times (the unchosen keys' share of the PartTail rows' sum, at the values' scale,
    minus (1 - alpha) times the mean value's coordinates). A sequence with no keys (a CUDA graph's padding) gets
    zeros. One program per BLOCK_D columns of a head, few enough that it holds no more than 4,096 partial values:
    at batch 1 there are up to 128 splits (docs/kernel-notes.md)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    h = head // GROUP
    n_keys = tl.load(SeqLens + b)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    s = tl.arange(0, BLOCK_AS)
    s_ok = s < ATTEND_SPLITS
    part = (b * num_kv_heads * GROUP + head) * ATTEND_SPLITS + s
    lse = tl.load(PartLse + part, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))
    o = tl.load(PartOut + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    attn = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    alpha = tl.sum(tl.load(PartAlpha + part, mask=s_ok, other=0.0), 0)
    alpha = tl.where(n_keys <= k, 1.0, tl.minimum(alpha, 1.0))
    last = tl.load(BlockTable + b * stride_bt + tl.maximum(n_keys - 1, 0) // PAGE_SIZE).to(tl.int64)
    v_mean = tl.load(VCumsum + (last * num_kv_heads + h) * HEAD_DIM + d, mask=d_ok & (n_keys > 0), other=0.0)
    v_mean = v_mean / tl.maximum(n_keys, 1).to(tl.float32)
    out = alpha * attn + (1.0 - alpha) * v_mean
    if AXES > 0:
        a = tl.arange(0, BLOCK_A)
        a_ok = a < AXES
        tail = tl.zeros([BLOCK_A], dtype=tl.float32)
        for c0 in range(0, num_chunks, TAIL_ROWS):  # the aggregation's programs' sums
            ch = c0 + tl.arange(0, TAIL_ROWS)
            tail += tl.sum(tl.load(PartTail + ((b * num_kv_heads * GROUP + head) * num_chunks + ch[:, None]) * AXES
                                   + a[None, :], mask=(ch < num_chunks)[:, None] & a_ok[None, :], other=0.0), 0)
        chosen = tl.load(PartChosenC + part[:, None] * AXES + a[None, :], mask=s_ok[:, None] & a_ok[None, :],
                         other=0.0)
        tail = (tail - tl.sum(chosen, 0)) * tl.load(Rms + h * AXES + a, mask=a_ok, other=0.0)
        # the mean value's coordinates need all its columns, not only this program's
        df = tl.arange(0, BLOCK_DF)
        df_ok = df < HEAD_DIM
        mean_all = tl.load(VCumsum + (last * num_kv_heads + h) * HEAD_DIM + df, mask=df_ok & (n_keys > 0), other=0.0)
        mean_all = mean_all / tl.maximum(n_keys, 1).to(tl.float32)
        axes_all = tl.load(Axes + (h * HEAD_DIM + df[:, None]) * AXES + a[None, :],
                           mask=df_ok[:, None] & a_ok[None, :], other=0.0)
        tail -= (1.0 - alpha) * tl.sum(axes_all * mean_all[:, None], 0)
        axes_d = tl.load(Axes + (h * HEAD_DIM + d[:, None]) * AXES + a[None, :], mask=d_ok[:, None] & a_ok[None, :],
                         other=0.0)
        out += tl.where(n_keys <= k, 0.0, tl.sum(axes_d * tail[None, :], 1))
    tl.store(Out + b * stride_ob + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def _upcast(dtype: torch.dtype) -> bool:
    """Whether bf16 tiles reach tl.dot as float32: the CPU interpreter multiplies bf16 wrongly (`tile_dot`)."""
    return dtype == torch.bfloat16 and interpreting()


def _basis(basis: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A SparQ turn [Hkv, D, D] as the kernels read it (contiguous, in the activations' dtype)."""
    return None if basis is None else basis.to(dtype).contiguous()


def _splits(batch: int, kv_heads: int, work: int, device: torch.device, per_sm: int) -> int:
    """Programs per (sequence, KV head): about `per_sm` per SM over the grid, each with one of `work` tiles at
    least. The scores' one-warp programs take sixteen (measured on an H100); the exact attention's, of four warps
    with two stages of 64 keys, four: with sixteen they had one or two tiles each, and at 8 x 32k the step took 115
    µs against 109 (docs/kernel-notes.md)."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    return max(1, min(round(per_sm * sms / max(batch * kv_heads, 1)), work, 128))


def sparq_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, *, r, k, recent=0,
                    softmax_scale=None, out=None, num_splits=None, tiles=None, strided=False):
    """Decode: q [B, Hq, D], one query per sequence, the last of its seq_lens_k keys; the last `recent` keys are
    always among the k chosen. `num_splits` (score splits, attend splits) overrides the choice of programs per
    (sequence, KV head), `tiles` (keys per step, warps and pipeline stages of the scores; the same of the
    attention) their shapes (tests, benchmark sweeps).
    strided=True reads the r components from the cache's K instead of its component-major copy (what the copy
    saves, measured by `bench kernels --sparse`)."""
    if max_seqlen_q != 1 or q.shape[0] != block_table.shape[0]:
        raise ValueError("SparQ's Triton kernels decode: one query per sequence")
    if kv_cache.k_t is None:
        raise ValueError("SparQ needs a cache with its component-major key copy (allocate_kv_caches(sparq=True))")
    batch, hq, dim = q.shape
    _, page, hkv, _ = kv_cache.k.shape
    group = hq // hkv
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    scale = (softmax_scale if softmax_scale is not None else dim**-0.5) * _LOG2E
    max_keys = block_table.shape[1] * page
    num_chosen = min(k, max_keys)
    block_n, score_warps, score_stages, attend_n, attend_warps, attend_stages = tiles or (64, 1, 1, 64, 4, 2)
    block_n = max(block_n, page)
    score_splits, attend_splits = num_splits or (
        _splits(batch, hkv, triton.cdiv(max_keys, block_n), q.device, per_sm=16),
        _splits(batch, hkv, triton.cdiv(num_chosen, attend_n), q.device, per_sm=4))
    dev, f32 = q.device, torch.float32
    # 1, 2. the components (chosen in the kernel) and the approximate scores
    r = min(r, dim)
    kept = f32 if q.dtype == f32 else torch.float16
    logits = torch.empty(batch, hkv, max_keys, group, dtype=kept, device=dev)
    part_m = torch.empty(batch, hq, score_splits, dtype=f32, device=dev)
    part_l = torch.empty_like(part_m)
    group_pad = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(dim)
    upcast = _upcast(q.dtype)
    if strided and kv_cache.sparq_basis is not None:
        raise ValueError("strided=True reads the components from K, which is not in the cache's sparq_basis")
    keys = kv_cache.k if strided else kv_cache.k_t
    basis = _basis(kv_cache.sparq_query_turn, q.dtype)
    q_basis = q  # the queries that meet k_t
    if basis is not None:
        q_basis = torch.empty_like(q)
        _turn_queries[(batch, hkv)](q, basis, q_basis, hq, q.stride(0), q.stride(1), GROUP=group,
                                    GROUP_PAD=max(16, group_pad), HEAD_DIM=dim, BLOCK_D=block_d, UPCAST=upcast)
    # (block, head, component, token) strides of the keys read
    key_strides = (keys.stride(0), keys.stride(2), keys.stride(3), keys.stride(1)) if strided else keys.stride()
    # each key's summed probability (step 3), and the histograms of the select that takes the k most likely keys;
    # rows the select holds in registers need none (`topk.MAX_ROW`)
    agg = torch.empty(batch, hkv, max_keys, dtype=kept, device=dev)
    drop_bits = FP16_DROP_BITS if kept == torch.float16 else 0
    digits = (digit_counts(agg, AGGREGATE_KEYS, zeroed=False, drop_bits=drop_bits) if max_keys > topk.MAX_ROW
              else None)
    digit_cells = 0 if digits is None else digits.hist[0].numel()
    key_bits = 8 if strided else kv_cache.sparq_key_bits
    key_scales = kv_cache.k_t_scale if key_bits == 4 else part_m  # (not read in e4m3)
    _approximate_scores[(batch, hkv, score_splits)](
        q_basis, keys, key_scales, block_table, seq_lens_k, logits, part_m, part_l,
        part_m if digits is None else digits.hist, scale, hkv, q_basis.stride(0), q_basis.stride(1),
        block_table.stride(0), logits.stride(0), logits.stride(1), *key_strides, *key_scales.stride()[:2],
        GROUP=group, GROUP_PAD=group_pad, R=r, BLOCK_R=max(triton.next_power_of_2(r), 16),
        HEAD_DIM=dim, BLOCK_D=block_d, PAGE_SIZE=page, BLOCK_N=block_n, NUM_SPLITS=score_splits, UPCAST=upcast,
        DIGIT_CELLS=digit_cells, BLOCK_DC=triton.next_power_of_2(max(digit_cells, 1)), KEY_BITS=key_bits,
        num_warps=score_warps, num_stages=score_stages)
    # 3. each key's summed probability; the k most likely keys
    lse = torch.empty(batch, hq, dtype=f32, device=dev)
    chunks = triton.cdiv(max_keys, AGGREGATE_KEYS)
    # the values' coordinates (with value axes: what the unchosen keys' share is made of), and their sums: over
    # each aggregation program's keys, each attend split's chosen keys
    axes = kv_cache.value_axes
    tail = dict(AXES=axes, BLOCK_A=triton.next_power_of_2(max(axes, 1)))
    vt = kv_cache.v_t if axes else kv_cache.k_t  # (not read without axes)
    vt_strides = vt.stride()[:3]
    part_tail, part_chosen_c = (torch.empty(*shape, max(axes, 1), dtype=f32, device=dev) for shape in
                                ((batch, hq, chunks), (batch, hq, attend_splits)))
    # the aggregation and the attention read a key's coordinates as few whole words as divide them: 8 bytes with 8
    # axes (bytes one by one had made the aggregation six times slower)
    word = max(w for w in (1, 2, 4, 8) if axes % w == 0) if axes else 1
    vt_words = vt.view(_WORDS[word])
    _aggregate[(batch, hkv, chunks)](
        logits, part_m, part_l, seq_lens_k, agg, lse, block_table, vt_words, part_tail,
        *((agg,) * 3 if digits is None else (digits.hist, digits.chunk_hist, digits.chunk_above)), hkv, max_keys,
        recent, logits.stride(0), logits.stride(1), agg.stride(0), agg.stride(1), block_table.stride(0), *vt_strides,
        GROUP=group, GROUP_PAD=group_pad, NUM_SPLITS=score_splits, BLOCK_S=triton.next_power_of_2(score_splits),
        BLOCK=AGGREGATE_KEYS,
        LEVELS=0 if digits is None else digits.levels, KEY_BITS=8 * agg.element_size(), DROP_BITS=drop_bits,
        PAGE_SIZE=page, AXES=axes, WORD=word, num_warps=4)
    chosen = top_k_positions(agg, num_chosen, first_digits=digits, drop_bits=drop_bits)
    # 4. exact attention over them
    part_out = torch.empty(batch, hq, attend_splits, dim, dtype=f32, device=dev)
    part_lse = torch.empty(batch, hq, attend_splits, dtype=f32, device=dev)
    part_alpha = torch.empty_like(part_lse)
    kc, vc = kv_cache.k, kv_cache.v
    _attend_chosen[(batch, hkv, attend_splits)](
        q, kc, vc, vt_words, chosen, logits, lse, block_table, seq_lens_k, part_out, part_lse, part_alpha,
        part_chosen_c, scale, hkv, num_chosen, q.stride(0), q.stride(1), kc.stride(1), kc.stride(2), kc.stride(0),
        block_table.stride(0), logits.stride(0), logits.stride(1), chosen.stride(0), chosen.stride(1), *vt_strides,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=max(16, group_pad), HEAD_DIM=dim, BLOCK_D=block_d, PAGE_SIZE=page,
        BLOCK_N=attend_n, NUM_SPLITS=attend_splits, UPCAST=upcast, **tail, WORD=word, num_warps=attend_warps,
        num_stages=attend_stages)
    # 5. combine with the mean value (and the values' coordinates)
    combine_d = min(block_d, max(16, 4096 // triton.next_power_of_2(attend_splits)))
    value_axes, value_rms = (kv_cache.sparq_value_axes, kv_cache.sparq_value_rms) if axes else (part_tail,) * 2
    _combine[(batch, hq, triton.cdiv(dim, combine_d))](
        part_out, part_lse, part_alpha, kv_cache.v_cumsum, part_tail, part_chosen_c, value_axes, value_rms,
        block_table, seq_lens_k, out, hkv, k, chunks, block_table.stride(0), out.stride(0), out.stride(1), GROUP=group,
        HEAD_DIM=dim, BLOCK_D=combine_d, BLOCK_DF=block_d, PAGE_SIZE=page, ATTEND_SPLITS=attend_splits,
        BLOCK_AS=triton.next_power_of_2(attend_splits), **tail, TAIL_ROWS=TAIL_ROWS, num_warps=1)
    return out


@triton.jit
def _new_places(SlotMapping, q_start, first_new, length, pos, in_page):
    """Which places `pos` of a page hold a key new in this step (not padding)."""
    new = in_page & (pos >= first_new) & (pos < length)
    return new & (tl.load(SlotMapping + q_start + pos - first_new, mask=new, other=-1) >= 0)


@triton.jit
def _new_keys(K, turn, new, q_start, first_new, pos, h, d, d_ok, stride_kt, stride_kh, HAS_BASIS: tl.constexpr,
              UPCAST: tl.constexpr):
    """The `new` keys at places `pos` of a page, turned into the KV head's basis with HAS_BASIS."""
    k = tl.load(K + (q_start + pos - first_new)[:, None] * stride_kt + h * stride_kh + d[None, :],
                mask=new[:, None] & d_ok[None, :], other=0.0)
    if HAS_BASIS:  # rounded to the keys' dtype, as the reference's product is
        k = tile_dot(k, turn, UPCAST).to(K.dtype.element_ty)
    return k


@triton.jit
def _e4m3_ceil(x):
    """The smallest e4m3 value at least x (float32, 2 ** -9 to 448), in float32: x rounded up to a multiple of its
    binade's e4m3 spacing (2 ** -9 below 2 ** -6), by products with powers of two made from their bits, all exact.
    (Rounding to e4m3 and back in registers, then stepping up where that was below, gave wrong scales on an H200,
    not in the interpreter: docs/kernel-notes.md.)"""
    binade = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((binade - 3 + 127) << 23).to(tl.float32, bitcast=True)
    per_step = ((3 - binade + 127) << 23).to(tl.float32, bitcast=True)
    return tl.minimum(tl.ceil(x * per_step) * step, 448.0)


@triton.jit
def _int4_codes(k, new, KTScale, scale_at):
    """Keys k [rows, BLOCK_D] as `reference.int4_keys` makes them: each key's scale (stored at `scale_at` for the
    `new` rows), the smallest e4m3 value that holds its largest component within 7, and each component's 4-bit
    code, int32: 8 plus its nearest multiple of the scale (the number of points between multiples below |k|; the
    products are exact in float32)."""
    k = k.to(tl.float32)
    a = tl.abs(k)
    amax = tl.max(a, 1)
    # amax / 7 rounds, so from just below it, and one value up where that is still short
    s = _e4m3_ceil(tl.maximum(amax / 7.0, 2.0**-9) * (1.0 - 2.0**-20))
    s = tl.where(7.0 * s < amax, _e4m3_ceil(s * (1.0 + 2.0**-20)), s)
    tl.store(KTScale + scale_at, to_e4m3(s), mask=new)
    s = s[:, None]
    mag = ((a > 0.5 * s).to(tl.int32) + (a > 1.5 * s).to(tl.int32) + (a > 2.5 * s).to(tl.int32)
           + (a > 3.5 * s).to(tl.int32) + (a > 4.5 * s).to(tl.int32) + (a > 5.5 * s).to(tl.int32)
           + (a > 6.5 * s).to(tl.int32))
    return tl.where(k < 0, 8 - mag, 8 + mag)


@triton.jit
def _write_int4_page(K, turn, KT, KTScale, SlotMapping, row, q_start, first_new, length, page_start, h, d, d_ok,
                     stride_kt, stride_kh, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HALF_ROWS: tl.constexpr,
                     HAS_BASIS: tl.constexpr, UPCAST: tl.constexpr):
    """A page's new keys into a 4-bit copy (KT's and KTScale's `row`: block * KV heads + head). A byte holds the
    codes of keys u and u + PAGE_SIZE / 2: both halves are taken here as two tiles of rows, so that one thread
    writes each byte whole (the other nibble kept where its key is not new), with no order between threads to
    rely on."""
    u = tl.arange(0, HALF_ROWS)  # (padded to 16 rows for the tensor cores)
    in_half = u < PAGE_SIZE // 2
    pos_lo, pos_hi = page_start + u, page_start + PAGE_SIZE // 2 + u
    new_lo = _new_places(SlotMapping, q_start, first_new, length, pos_lo, in_half)
    new_hi = _new_places(SlotMapping, q_start, first_new, length, pos_hi, in_half)
    k_lo = _new_keys(K, turn, new_lo, q_start, first_new, pos_lo, h, d, d_ok, stride_kt, stride_kh, HAS_BASIS, UPCAST)
    k_hi = _new_keys(K, turn, new_hi, q_start, first_new, pos_hi, h, d, d_ok, stride_kt, stride_kh, HAS_BASIS, UPCAST)
    lo = _int4_codes(k_lo, new_lo, KTScale, row * PAGE_SIZE + u)
    hi = _int4_codes(k_hi, new_hi, KTScale, row * PAGE_SIZE + PAGE_SIZE // 2 + u)
    at = KT + (row * HEAD_DIM + d[None, :]) * (PAGE_SIZE // 2) + u[:, None]
    written = (new_lo | new_hi)[:, None] & d_ok[None, :]
    old = tl.load(at, mask=written & ~(new_lo & new_hi)[:, None], other=0).to(tl.int32)
    lo = tl.where(new_lo[:, None], lo, old & 15)
    hi = tl.where(new_hi[:, None], hi, old >> 4)
    tl.store(at, (lo | (hi << 4)).to(tl.uint8), mask=written)


@triton.jit
def _write_sparq_copies(K, Basis, KT, KTScale, V, VCumsum, VT, Axes, Rms, SlotMapping, BlockTable, CuSeqlensQ,
                        SeqLensK, num_kv_heads, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                        ROWS: tl.constexpr, HALF_ROWS: tl.constexpr, HAS_BASIS: tl.constexpr, AXES: tl.constexpr,
                        BLOCK_A: tl.constexpr, UPCAST: tl.constexpr, KEY_BITS: tl.constexpr):
    """One program per (sequence, KV head): its new keys (turned into the KV head's basis, with HAS_BASIS) into
    k_t, in e4m3 or in 4 bits with a scale per key in KTScale (with AXES, its new values' coordinates along Axes,
    divided by Rms, into VT), then the running value sums of the blocks it wrote to, in order (each block's from
    the one before: no other program could supply them in time)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(CuSeqlensQ + b)
    q_len = tl.load(CuSeqlensQ + b + 1) - q_start
    length = tl.load(SeqLensK + b)
    if length == 0 or q_len == 0:  # a CUDA graph's padding sequence
        return
    t = tl.arange(0, ROWS)  # a page's places, padded to 16 rows for the tensor cores
    in_page = t < PAGE_SIZE
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    first_new = length - q_len
    if HAS_BASIS:
        turn = tl.load(Basis + h * HEAD_DIM * HEAD_DIM + d[:, None] * HEAD_DIM + d[None, :],
                       mask=d_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        turn = Basis  # (None: not read)
    a = tl.arange(0, BLOCK_A)  # (padded to 16 columns for the tensor cores)
    a_ok = a < AXES
    if AXES > 0:
        axes = tl.load(Axes + (h * HEAD_DIM + d[:, None]) * AXES + a[None, :], mask=d_ok[:, None] & a_ok[None, :],
                       other=0.0)
        rms = tl.load(Rms + h * AXES + a, mask=a_ok, other=1.0)
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    if first_new >= PAGE_SIZE:
        before = tl.load(BlockTable + b * stride_bt + first_new // PAGE_SIZE - 1).to(tl.int64)
        total = tl.load(VCumsum + (before * num_kv_heads + h) * HEAD_DIM + d, mask=d_ok, other=0.0)
    for j in range(first_new // PAGE_SIZE, (length - 1) // PAGE_SIZE + 1):
        block = tl.load(BlockTable + b * stride_bt + j).to(tl.int64)
        pos = j * PAGE_SIZE + t
        new = _new_places(SlotMapping, q_start, first_new, length, pos, in_page)
        if KEY_BITS == 8:
            k = _new_keys(K, turn, new, q_start, first_new, pos, h, d, d_ok, stride_kt, stride_kh, HAS_BASIS, UPCAST)
            tl.store(KT + ((block * num_kv_heads + h) * HEAD_DIM + d[None, :]) * PAGE_SIZE + t[:, None],
                     to_e4m3(k.to(tl.float32)), mask=new[:, None] & d_ok[None, :])
        else:
            _write_int4_page(K, turn, KT, KTScale, SlotMapping, block * num_kv_heads + h, q_start, first_new, length,
                             j * PAGE_SIZE, h, d, d_ok, stride_kt, stride_kh, HEAD_DIM, PAGE_SIZE, HALF_ROWS,
                             HAS_BASIS, UPCAST)
        v = tl.load(V + block * stride_vb + t[:, None] * stride_vt + h * stride_vh + d[None, :],
                    mask=(in_page & (pos < length))[:, None] & d_ok[None, :], other=0.0)
        total += tl.sum(v.to(tl.float32), 0)
        if AXES > 0:
            coords = tile_dot(v.to(tl.float32), axes, False) / rms[None, :]
            tl.store(VT + ((block * num_kv_heads + h) * PAGE_SIZE + t[:, None]) * AXES + a[None, :], to_e4m3(coords),
                     mask=new[:, None] & a_ok[None, :])
        tl.store(VCumsum + (block * num_kv_heads + h) * HEAD_DIM + d, total, mask=d_ok)


def write_sparq_copies(k, kv_cache, slot_mapping, block_table, cu_seqlens_q, seq_lens_k) -> None:
    """As `reference.write_sparq_copies`: after the new tokens' K/V are in the cache, their keys (in the cache's
    `sparq_basis`) into `k_t` (and a 4-bit copy's scales into `k_t_scale`) and the running value sums of the
    blocks they went to."""
    batch = seq_lens_k.shape[0]
    if k.shape[0] == 0 or batch == 0:
        return
    _, page, heads, dim = kv_cache.v.shape
    v = kv_cache.v
    basis = _basis(kv_cache.sparq_basis, k.dtype)
    axes = kv_cache.value_axes
    vt, value_axes, value_rms = ((kv_cache.v_t, kv_cache.sparq_value_axes, kv_cache.sparq_value_rms) if axes else
                                 (kv_cache.k_t, kv_cache.v_cumsum, kv_cache.v_cumsum))  # (not read without axes)
    key_scales = kv_cache.k_t if kv_cache.k_t_scale is None else kv_cache.k_t_scale  # (not written in e4m3)
    _write_sparq_copies[(batch, heads)](
        k, basis, kv_cache.k_t, key_scales, v, kv_cache.v_cumsum, vt, value_axes, value_rms, slot_mapping,
        block_table, cu_seqlens_q, seq_lens_k, heads, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        v.stride(2), block_table.stride(0), HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), PAGE_SIZE=page,
        ROWS=max(page, 16), HALF_ROWS=max(page // 2, 16), HAS_BASIS=basis is not None, AXES=axes,
        BLOCK_A=max(16, triton.next_power_of_2(axes)), UPCAST=_upcast(k.dtype), KEY_BITS=kv_cache.sparq_key_bits)
