"""Prefill attention for Hopper GPUs in Gluon: FlashAttention-3's design (docs/kernel-notes.md, "Hopper prefill").

The portable Triton kernel (`flashpage.kernels.attention`) leaves the schedule to the compiler; this one spells it
out at the level FA3 works at. A work item is BLOCK_M rows of one sequence and one KV head, where a row is a
(query token, query head of that KV head's group) pair, as in the portable kernel: each K/V tile serves the whole
GQA group, and a decoding sequence in a mixed step takes one item per KV head, not one per query head. A program
takes one item, or, when the sequences are short, about one program per SM walks many (`short_items`,
`persistent_programs`).

- Warp specialisation: a producer warp only issues copies; two consumer warpgroups (BLOCK_M / 2 rows each) only
  compute, with the registers the producer gives up (setmaxnreg).
- K and V tiles come through the tensor copy engine (TMA) into two rings of shared-memory slots (K's, V's) with
  ready / empty barriers, so the loads of later tiles fly while the tensor cores work; K runs a tile ahead of V, as
  the products need them. A paged cache's tile is one copy per page (pages of 16 keys are smaller than a good key
  tile). Each consumer copies its Q in too: one copy-engine box of tokens x the group's heads where the group
  divides its rows, else a gather of asynchronous copies (a row tile that starts inside a token's heads fits no
  box); a persistent program's next item's Q arrives while it computes this one. The output goes out through
  shared memory: rows that are whole tokens of their sequence in one box the same way, others in 16-byte row
  stores.
- Both products are warpgroup MMAs (wgmma): S = Q Kᵀ from shared memory, O += P V with P straight from registers.
- Each consumer's loop is software-pipelined as in FA3: S for the next tile and P V for this one are issued
  together, and the next tile's softmax runs while the tensor cores still multiply P V; and the two consumers take
  turns at the tensor cores (ping-pong), so one's softmax overlaps the other's products.
Masks are bottom-right aligned, as in the portable kernel: query i of a sequence sits at key position
k_len - q_len + i.

This is the fast path for what prefill uses (bf16/fp16, head dim 64 or 128, causal or not, windows, a paged or a
contiguous K/V, a paged FP8 cache: its producer is then a warpgroup that converts each tile to fp16 as it
lands), and the opt-in FP8 prefill of contiguous K/V (`prefill_fp8`: e4m3 products, Vᵀ in its slots,
per-head scales folded into the softmax and the output); everything else (token trees, block-sparse patterns,
batch invariance, older GPUs, the CPU interpreter) runs on the portable kernel. The GPU tests are
`tests/test_hopper_prefill.py`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashpage.kernels.block_sparse import head_stride
from flashpage.kernels.device import sm_count
from flashpage.kernels.fp8 import FP8
from flashpage.kernels.quantize import quantize_heads


@gluon.jit
def _page_row(BlockTable, seq, stride_bt, pos, k_len, PAGE_SIZE: gl.constexpr):
    """The cache row of a paged sequence's key pos. Past the sequence's last page, the last page again (the block
    table has no entries there; the consumers mask those keys and zero those values)."""
    page = gl.minimum(pos // PAGE_SIZE, (k_len - 1) // PAGE_SIZE)
    return gl.load(BlockTable + seq * stride_bt + page) * PAGE_SIZE + pos % PAGE_SIZE


@gluon.jit
def _issue_tile(desc, smem, bar, BlockTable, seq, stride_bt, start, k_start, k_len, kv_col, PAGED: gl.constexpr,
                PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, TRANSPOSED: gl.constexpr):
    """Start copying the K or V tile of keys [start, start + BLOCK_N) into smem, completing on bar; a paged tile
    one copy per page. TRANSPOSED: FP8's Vᵀ, [Hkv * D, keys]: a [D, BLOCK_N] tile."""
    if TRANSPOSED:
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [kv_col, k_start + start], bar, smem)
    elif PAGED:
        ROWS: gl.constexpr = desc.block_type.shape[0]  # a page, or BLOCK_N keys of a larger page
        mbarrier.expect(bar, desc.block_type.nbytes * (BLOCK_N // ROWS))
        for p in gl.static_range(BLOCK_N // ROWS):
            row = _page_row(BlockTable, seq, stride_bt, start + p * ROWS, k_len, PAGE_SIZE)
            tma.async_copy_global_to_shared(desc, [row, kv_col], bar, smem.slice(p * ROWS, ROWS))
    else:
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [k_start + start, kv_col], bar, smem)


@gluon.jit
def _fill(desc, ring, ready, empty, g, BlockTable, seq, stride_bt, start, k_start, k_len, kv_col, PAGED: gl.constexpr,
          PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, TRANSPOSED: gl.constexpr):
    """Copy the program's g-th K (or V) tile into its ring slot, once both consumers have released the slot's last
    tile (a fresh barrier counts as released)."""
    slot = g % ring.shape[0]
    mbarrier.wait(empty.index(slot), ((g // ring.shape[0]) & 1) ^ 1)
    _issue_tile(desc, ring.index(slot), ready.index(slot), BlockTable, seq, stride_bt, start, k_start, k_len, kv_col,
                PAGED, PAGE_SIZE, BLOCK_N, TRANSPOSED)


@gluon.jit
def _softmax_step(s, m_i, l_i, start, q_pos, hi, masked, row_scale, window_left, window_right,
                  CAUSAL: gl.constexpr, WINDOW: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One key tile's online softmax: the tile's probabilities P (unnormalised), the factor alpha that rescales
    what came before, and the new running max and sum. Scores stay unscaled; each row's scale (the softmax's times
    log2(e), times FP8's dequantization) folds into exp2's argument."""
    if masked:  # the tile holds keys some rows must not see
        kpos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL:  # key <= q_pos also keeps keys past the sequence and rows past it (q_pos -1) out
            visible = kpos[None, :] <= q_pos[:, None]
        else:
            visible = (kpos[None, :] < hi) & (q_pos[:, None] >= 0)
        if WINDOW:
            if window_right >= 0:
                visible = visible & (kpos[None, :] <= q_pos[:, None] + window_right)
            if window_left >= 0:
                visible = visible & (kpos[None, :] >= q_pos[:, None] - window_left)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_scaled = gl.where(m_new == float("-inf"), 0.0, m_new * row_scale)  # rows that have seen no key yet
    p = gl.exp2(s * row_scale[:, None] - m_scaled[:, None])
    alpha = gl.exp2(m_i * row_scale - m_scaled)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.constexpr_function
def _row_layout(block_n, head_dim, num_warps):
    """A plain layout for a [block_n, head_dim] tile: 8 contiguous elements per thread."""
    cols = min(head_dim // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [num_warps, 1], [1, 0])


@gluon.jit
def _zero_rows_from(smem, first, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
    """Zero the rows of a shared [BLOCK_N, HEAD_DIM] tile from row `first` on (nothing if first >= BLOCK_N)."""
    if first < BLOCK_N:
        layout: gl.constexpr = _row_layout(BLOCK_N, HEAD_DIM, num_warps)
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        tile = smem.load(layout)
        smem.store(gl.where((rows < first)[:, None], tile, gl.zeros_like(tile)))
        gl.thread_barrier()
        fence_async_shared()  # the tensor cores read shared memory through the async proxy


@gluon.jit
def _row_offsets(rows, d, q_start, kv_head, stride_t, stride_h, GROUP: gl.constexpr):
    """Element offsets of rows (token, query head of kv_head's group) x columns d of a [tokens, Hq, D] tensor."""
    tok = (q_start + rows // GROUP).to(gl.int64)
    head = kv_head * GROUP + rows % GROUP
    return tok[:, None] * stride_t + head[:, None] * stride_h + d[None, :]


@gluon.jit
def _zeros(ROWS: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
    """The accumulator a product with use_acc=False ignores."""
    return gl.zeros([ROWS, COLS], gl.float32, layout=layout)


@gluon.jit
def _wait_turn(turn, j, WG: gl.constexpr):
    """Ping-pong (FA3): the two consumer warpgroups take turns sending their products to the tensor cores, so one
    computes its softmax while the other's products run. Round j of warpgroup WG waits for the other's round j - 1
    (warpgroup 0) or j (warpgroup 1); a fresh barrier counts its phase before the first as complete."""
    mbarrier.wait(turn, (j & 1) ^ (1 - WG))


@gluon.jit
def _item_rows(t, n_m, n_kv, CuSeqlensQ, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """Work item t's sequence, KV head, first row, and query span. Items are numbered row tile fastest, so a
    (sequence, KV head)'s row tiles start together on neighbouring SMs and read its K/V while it is in L2; causal
    row tiles further down see more keys and come first, so the short ones fill the tail."""
    m = t % n_m
    kv_head = (t // n_m) % n_kv
    seq = t // (n_m * n_kv)
    q_start = gl.load(CuSeqlensQ + seq)
    q_len = gl.load(CuSeqlensQ + seq + 1) - q_start
    return seq, kv_head, (n_m - 1 - m if CAUSAL else m) * BLOCK_M, q_start, q_len


@gluon.jit
def _work_item(t, n_m, n_kv, CuSeqlensQ, CuSeqlensK, SeqLensK, window_left, window_right, GROUP: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PAGED: gl.constexpr, CAUSAL: gl.constexpr,
               WINDOW: gl.constexpr, FP8: gl.constexpr):
    """Work item t: one row tile of one (sequence, KV head) (_item_rows). Returns the item's sequence, KV head,
    first row, query and key spans, its keys [lo, hi) (lo at a key tile's start; the mask takes out what a window
    hides of that tile), its key tiles, and whether it has any rows (a row tile past its sequence's queries has
    none)."""
    seq, kv_head, row0, q_start, q_len = _item_rows(t, n_m, n_kv, CuSeqlensQ, BLOCK_M, CAUSAL)
    if PAGED:
        k_start = 0
        k_len = gl.load(SeqLensK + seq)
    elif FP8:  # each sequence's keys start 16-byte aligned, for the copies of Vᵀ's tiles (prefill_fp8)
        k_start = gl.load(CuSeqlensK + seq)
        k_len = gl.load(SeqLensK + seq)
    else:
        k_start = gl.load(CuSeqlensK + seq)
        k_len = gl.load(CuSeqlensK + seq + 1) - k_start
    first_pos = k_len - q_len + row0 // GROUP
    last_pos = gl.minimum(k_len - q_len + (row0 + BLOCK_M - 1) // GROUP, k_len - 1)
    lo = 0
    hi = k_len
    if CAUSAL:
        hi = gl.minimum(hi, last_pos + 1)
    if WINDOW:
        if window_right >= 0:
            hi = gl.minimum(hi, last_pos + window_right + 1)
        if window_left >= 0:
            lo = gl.maximum(0, first_pos - window_left) // BLOCK_N * BLOCK_N
    n_tiles = gl.maximum(gl.cdiv(hi - lo, BLOCK_N), 1)
    return seq, kv_head, row0, q_start, q_len, k_start, k_len, lo, hi, n_tiles, row0 < q_len * GROUP


@gluon.jit
def _copy_q(q_smem, q_bar, q_desc, Q, t, n_m, n_kv, CuSeqlensQ, stride_qt, stride_qh, GROUP: gl.constexpr,
            HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, CAUSAL: gl.constexpr, Q_TMA: gl.constexpr, WG: gl.constexpr):
    """Start copying work item t's ROWS rows of Q for warpgroup WG into q_smem, asynchronously, so that a
    program's next item's Q arrives while it computes this one (`_wait_q` waits for it). Q_TMA (the group divides
    ROWS): one copy-engine box of ROWS / GROUP tokens x the group's heads, which lands in the rows' order (token,
    head); rows past the sequence hold the next sequence's queries, or zeros past the last, and are never stored.
    Otherwise a gather (a row tile starts inside a token's heads, which no box describes), zeros past the
    sequence."""
    seq, kv_head, row0, q_start, q_len = _item_rows(t, n_m, n_kv, CuSeqlensQ, 2 * ROWS, CAUSAL)
    row0 += WG * ROWS
    if Q_TMA:
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        box = q_smem._reinterpret(q_smem.dtype, q_desc.block_type.shape, q_desc.layout)
        tma.async_copy_global_to_shared(q_desc, [q_start + row0 // GROUP, kv_head * GROUP, 0], q_bar, box)
    else:
        layout: gl.constexpr = _row_layout(ROWS, HEAD_DIM, 4)
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        async_copy.async_copy_global_to_shared(q_smem, Q + _row_offsets(rows, d, q_start, kv_head, stride_qt,
                                                                        stride_qh, GROUP),
                                               mask=(rows < q_len * GROUP)[:, None])
        async_copy.commit_group()


@gluon.jit
def _wait_q(q_bar, phase, Q_TMA: gl.constexpr):
    """Wait for the Q copy `_copy_q` started (the phase-th on q_bar, with Q_TMA)."""
    if Q_TMA:
        mbarrier.wait(q_bar, phase)
    else:
        async_copy.wait_group(0)


@gluon.jit
def _q_to_fp16(q_in, q16, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Over an FP8 cache the products run in fp16: a Q tile copied in the queries' own 16-bit type (q_in),
    rewritten in place as fp16 (q16, the same bytes), clamped to its range as the decode does (NaN stays NaN).
    Each thread reads and rewrites the same elements (a gather's: those its own copies brought, which
    async_copy.wait_group has seen land), so no barrier is needed before or between."""
    x = q_in.load(_row_layout(ROWS, HEAD_DIM, 4)).to(gl.float32)
    q16.store(gl.where(x != x, x, gl.minimum(gl.maximum(x, -65504.0), 65504.0)).to(gl.float16))


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, CuSeqlensQ, CuSeqlensK, SeqLensK,
             BlockTable, n_items, n_m, n_kv, window_left, window_right, stride_bt, stride_bth, GROUP: gl.constexpr,
             HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, PAGED: gl.constexpr,
             PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, FP8: gl.constexpr):
    """The producer warp: fill the K and V rings, a slot as soon as both consumers are done with it, running on
    into the program's next work item while the consumers finish one. Each K tile goes out before the V tile ahead
    of it, as the consumers need them (the scores of tile i + 1 and P V of tile i go to the tensor cores together),
    so the K ring can be deeper than the V ring (FA3 keeps separate K and V pipelines too)."""
    tile = 0  # key tiles issued so far, over all of the program's items: the rings' position
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        seq, kv_head, row0, q_start, q_len, k_start, k_len, lo, hi, n_tiles, has_rows = _work_item(
            t, n_m, n_kv, CuSeqlensQ, CuSeqlensK, SeqLensK, window_left, window_right, GROUP, 2 * ROWS, BLOCK_N,
            PAGED, CAUSAL, WINDOW, FP8)
        if has_rows:
            col = kv_head * HEAD_DIM
            table = BlockTable + kv_head * stride_bth  # (a table per KV head: key blocks chosen per head)
            _fill(k_desc, k_smem, k_ready, k_empty, tile, table, seq, stride_bt, lo, k_start, k_len, col, PAGED,
                  PAGE_SIZE, BLOCK_N, False)
            for i in range(n_tiles):
                if i + 1 < n_tiles:
                    _fill(k_desc, k_smem, k_ready, k_empty, tile + i + 1, table, seq, stride_bt,
                          lo + (i + 1) * BLOCK_N, k_start, k_len, col, PAGED, PAGE_SIZE, BLOCK_N, False)
                _fill(v_desc, v_smem, v_ready, v_empty, tile + i, table, seq, stride_bt, lo + i * BLOCK_N, k_start,
                      k_len, col, PAGED, PAGE_SIZE, BLOCK_N, FP8)
            tile += n_tiles


@triton.constexpr_function
def _chunk_layout(head_dim):
    """A warpgroup's layout for a [2048 // head_dim, head_dim] tile: 16 contiguous elements per thread."""
    cols = head_dim // 16
    return gl.BlockedLayout([1, 16], [32 // cols, cols], [4, 1], [1, 0])


@gluon.jit
def _widen(src, dst, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """dst = src's e4m3 values in fp16 (exactly; their per-head scales fold into the consumers' softmax and output),
    16 per thread at a time: the converting warpgroup has few registers."""
    CHUNK: gl.constexpr = 2048 // HEAD_DIM
    layout: gl.constexpr = _chunk_layout(HEAD_DIM)
    # each chunk's load is issued before the previous chunk's store: the compiler puts a barrier between a store
    # and the next load (it cannot tell the two buffers apart), and the load's latency would follow it
    x_next = src.slice(0, CHUNK).load(layout)
    for c in gl.static_range(BLOCK_N // CHUNK):
        x = x_next
        if c + 1 < BLOCK_N // CHUNK:
            x_next = src.slice((c + 1) * CHUNK, CHUNK).load(layout)
        dst.slice(c * CHUNK, CHUNK).store(x.to(dst.dtype))


@gluon.jit
def _copy_8bit(k_desc, v_desc, k8_smem, v8_smem, k8_ready, v8_ready, g, BlockTable, seq, stride_bt, start, k_len,
               kv_col, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """Start copying the program's g-th K and V tiles of an FP8 cache into their 8-bit slot, a page of each per
    block-table read (this producer's issue time is taken from its conversions)."""
    slot8 = g % k8_smem.shape[0]
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    mbarrier.expect(k8_ready.index(slot8), k_desc.block_type.nbytes * (BLOCK_N // ROWS))
    mbarrier.expect(v8_ready.index(slot8), v_desc.block_type.nbytes * (BLOCK_N // ROWS))
    for p in gl.static_range(BLOCK_N // ROWS):
        row = _page_row(BlockTable, seq, stride_bt, start + p * ROWS, k_len, PAGE_SIZE)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k8_ready.index(slot8),
                                        k8_smem.index(slot8).slice(p * ROWS, ROWS))
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v8_ready.index(slot8),
                                        v8_smem.index(slot8).slice(p * ROWS, ROWS))


@gluon.jit
def _widen_into(src8, ready8, g, ring, ready, empty, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Once the program's g-th 8-bit tile has landed and its ring slot is free, write it there in fp16."""
    slot = g % ring.shape[0]
    mbarrier.wait(empty.index(slot), ((g // ring.shape[0]) & 1) ^ 1)  # a fresh barrier counts as released
    slot8 = g % src8.shape[0]
    mbarrier.wait(ready8.index(slot8), (g // src8.shape[0]) & 1)
    _widen(src8.index(slot8), ring.index(slot), BLOCK_N, HEAD_DIM)
    fence_async_shared()  # the tensor cores read shared memory through the async proxy
    gl.thread_barrier()
    mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _load_fp8_kv(k_desc, v_desc, k8_smem, v8_smem, k8_ready, v8_ready, k_smem, v_smem, k_ready, v_ready, k_empty,
                 v_empty, CuSeqlensQ, SeqLensK, BlockTable, n_items, n_m, n_kv, window_left, window_right, stride_bt,
                 stride_bth, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                 PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """The producer over an FP8 cache, a warpgroup: its copy engine fills the 8-bit slots, copying the tiles up
    to len(k8_smem) - 1 ahead of the one it converts, and it writes each tile's values in fp16 (_widen) into the
    rings the consumers read, as the copy engine does for a 16-bit cache. FA3 transposes FP8's V in its producer
    the same way."""
    SLOTS8: gl.constexpr = k8_smem.shape[0]
    tile = 0  # key tiles produced so far, over all of the program's items: the rings' position
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        seq, kv_head, row0, q_start, q_len, k_start, k_len, lo, hi, n_tiles, has_rows = _work_item(
            t, n_m, n_kv, CuSeqlensQ, CuSeqlensQ, SeqLensK, window_left, window_right, GROUP, 2 * ROWS, BLOCK_N,
            True, CAUSAL, WINDOW, False)
        if has_rows:
            col = kv_head * HEAD_DIM
            table = BlockTable + kv_head * stride_bth
            for i in range(gl.minimum(SLOTS8 - 1, n_tiles)):
                _copy_8bit(k_desc, v_desc, k8_smem, v8_smem, k8_ready, v8_ready, tile + i, table, seq, stride_bt,
                           lo + i * BLOCK_N, k_len, col, PAGE_SIZE, BLOCK_N)
            for i in range(n_tiles):
                if i + SLOTS8 - 1 < n_tiles:  # into tile i - 1's slot: converted, every thread passed the barrier
                    _copy_8bit(k_desc, v_desc, k8_smem, v8_smem, k8_ready, v8_ready, tile + i + SLOTS8 - 1,
                               table, seq, stride_bt, lo + (i + SLOTS8 - 1) * BLOCK_N, k_len, col, PAGE_SIZE,
                               BLOCK_N)
                _widen_into(k8_smem, k8_ready, tile + i, k_smem, k_ready, k_empty, BLOCK_N, HEAD_DIM)
                _widen_into(v8_smem, v8_ready, tile + i, v_smem, v_ready, v_empty, BLOCK_N, HEAD_DIM)
            tile += n_tiles


@gluon.jit
def _produce(k_desc, v_desc, k8_smem, v8_smem, k8_ready, v8_ready, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
             CuSeqlensQ, CuSeqlensK, SeqLensK, BlockTable, n_items, n_m, n_kv, window_left, window_right, stride_bt,
             stride_bth, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
             PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
             FP8: gl.constexpr, FP8_CACHE: gl.constexpr):
    """The producer partition: _load_fp8_kv over an FP8 cache, else _load_kv."""
    if FP8_CACHE:
        _load_fp8_kv(k_desc, v_desc, k8_smem, v8_smem, k8_ready, v8_ready, k_smem, v_smem, k_ready, v_ready, k_empty,
                     v_empty, CuSeqlensQ, SeqLensK, BlockTable, n_items, n_m, n_kv, window_left, window_right,
                     stride_bt, stride_bth, GROUP, HEAD_DIM, ROWS, BLOCK_N, PAGE_SIZE, CAUSAL, WINDOW)
    else:
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, CuSeqlensQ, CuSeqlensK, SeqLensK,
                 BlockTable, n_items, n_m, n_kv, window_left, window_right, stride_bt, stride_bth, GROUP, HEAD_DIM,
                 ROWS, BLOCK_N, PAGED, PAGE_SIZE, CAUSAL, WINDOW, FP8)


@gluon.jit
def _v_operand(v_smem, slot, FP8: gl.constexpr):
    """P V's right operand, [BLOCK_N, HEAD_DIM]: FP8's products take it keys-contiguous (wgmma reads 8-bit
    operands only along the reduced dimension), so FP8's slots hold Vᵀ."""
    if FP8:
        operand = v_smem.index(slot).permute((1, 0))
    else:
        operand = v_smem.index(slot)
    return operand


@gluon.jit
def _attend_rows(Out, o_desc, q_smem, o_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, other_turn,
                 Scales, KScale, VScale, row0, q_start, q_len, k_len, kv_head, lo, hi, n_tiles, tile, rnd,
                 sm_scale_log2, window_left, window_right, stride_ot, stride_oh, GROUP: gl.constexpr,
                 HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, PAGED: gl.constexpr,
                 CAUSAL: gl.constexpr, WINDOW: gl.constexpr, FP8: gl.constexpr, FP8_CACHE: gl.constexpr,
                 O_TMA: gl.constexpr, WG: gl.constexpr):
    """A consumer warpgroup's work item: ROWS rows from row0 (their Q in q_smem) over key tiles [lo, hi), written
    to Out through o_smem (q_smem itself, but for FP8's 8-bit Q). `tile` counts the rings' tiles before this item,
    `rnd` the tensor-core turns. A K slot is released as soon as its scores are in, a V slot after its P V; over an
    FP8 cache both after P V (its converting producer measured slower given K back early: docs/kernel-notes.md)."""
    KS: gl.constexpr = k_smem.shape[0]
    VS: gl.constexpr = v_smem.shape[0]
    # wgmma layouts: one 16-row slice per warp; S is [ROWS, BLOCK_N], O is [ROWS, HEAD_DIM], and P is S's
    # registers reused as O's left operand (4 e4m3 values in 32 bits, against 2 16-bit ones).
    K_STEP: gl.constexpr = 32 if FP8 else 16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, K_STEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, K_STEP])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=K_STEP // 8)
    dtype: gl.constexpr = q_smem.dtype

    # Tiles wholly below every row's diagonal need no mask; with a window, every tile is masked.
    first_pos = k_len - q_len + row0 // GROUP
    unmasked_hi = lo
    if not WINDOW:
        bound = gl.minimum(hi, first_pos + 1) if CAUSAL else hi
        unmasked_hi = gl.maximum(bound, 0) // BLOCK_N * BLOCK_N
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    tok = rows // GROUP
    q_pos = gl.where(tok < q_len, k_len - q_len + tok, -1)  # rows past the sequence see nothing
    row_scale = gl.full([ROWS], sm_scale_log2, gl.float32, layout=gl.SliceLayout(1, s_layout))
    if FP8:  # Scales [Hkv, GROUP + 2]: a KV head's group's Q scales, then its K and V scales
        row_scale *= gl.load(Scales + kv_head * (GROUP + 2) + rows % GROUP) * gl.load(
            Scales + kv_head * (GROUP + 2) + GROUP)
    if FP8_CACHE:  # an FP8 cache's per-head scales (its values reach the tensor cores unscaled)
        row_scale *= gl.load(KScale + kv_head)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)

    # The first tile's scores and probabilities, before the pipelined loop.
    mbarrier.wait(k_ready.index(tile % KS), (tile // KS) & 1)
    _wait_turn(turn, rnd, WG)
    s = warpgroup_mma(q_smem, k_smem.index(tile % KS).permute((1, 0)), _zeros(ROWS, BLOCK_N, s_layout),
                      use_acc=False, is_async=True)
    mbarrier.arrive(other_turn, count=1)  # the other warpgroup's turn
    s = warpgroup_mma_wait(0, deps=(s, ))
    if not FP8_CACHE:
        mbarrier.arrive(k_empty.index(tile % KS), count=1)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, lo, q_pos, hi, lo + BLOCK_N > unmasked_hi,
                                       row_scale, window_left, window_right, CAUSAL, WINDOW, BLOCK_N, s_layout)
    # Tile i: rescale what tiles before it summed, then send its P V and tile i + 1's scores to the tensor cores
    # together, and run tile i + 1's softmax while P V is still being multiplied.
    for i in range(0, n_tiles - 1):
        vslot = (tile + i) % VS
        kslot = (tile + i + 1) % KS
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(k_ready.index(kslot), ((tile + i + 1) // KS) & 1)
        mbarrier.wait(v_ready.index(vslot), ((tile + i) // VS) & 1)
        _wait_turn(turn, rnd + i + 1, WG)
        s = warpgroup_mma(q_smem, k_smem.index(kslot).permute((1, 0)), _zeros(ROWS, BLOCK_N, s_layout),
                          use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, _v_operand(v_smem, vslot, FP8), acc, is_async=True)
        mbarrier.arrive(other_turn, count=1)  # the other warpgroup's turn
        s = warpgroup_mma_wait(1, deps=(s, ))
        if not FP8_CACHE:
            mbarrier.arrive(k_empty.index(kslot), count=1)  # this warpgroup is done with the K slot
        start = lo + (i + 1) * BLOCK_N
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, start, q_pos, hi, start + BLOCK_N > unmasked_hi,
                                           row_scale, window_left, window_right, CAUSAL, WINDOW, BLOCK_N, s_layout)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(vslot), count=1)  # and with the V slot
        if FP8_CACHE:
            mbarrier.arrive(k_empty.index((tile + i) % KS), count=1)
    last = tile + n_tiles - 1
    slot = last % VS
    mbarrier.wait(v_ready.index(slot), (last // VS) & 1)
    if PAGED:  # a cache's slots past the sequence's end hold anything, NaN included, and 0 * NaN is NaN
        # (both consumers zero the same rows of the last tile, writing the same values)
        _zero_rows_from(v_smem.index(slot), k_len - (lo + (n_tiles - 1) * BLOCK_N), BLOCK_N, HEAD_DIM, 4)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    _wait_turn(turn, rnd + n_tiles, WG)
    acc = warpgroup_mma(p_op, _v_operand(v_smem, slot, FP8), acc, is_async=True)
    mbarrier.arrive(other_turn, count=1)  # the other warpgroup's turn
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(slot), count=1)  # for the program's next item
    if FP8_CACHE:
        mbarrier.arrive(k_empty.index(last % KS), count=1)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    if FP8:
        out = out * gl.load(Scales + kv_head * (GROUP + 2) + GROUP + 1)
    if FP8_CACHE:
        out = out * gl.load(VScale + kv_head)
    # through shared memory: from the accumulator's layout a thread would store 4 bytes per row, from a row
    # layout 16 (docs/kernel-notes.md, "The output through shared memory"); rows that are whole tokens of the
    # sequence go out in one copy-engine box (O_TMA: as `_copy_q`'s), others in masked row stores
    o_smem.store(out.to(o_smem.dtype))
    if O_TMA:
        if row0 + ROWS <= q_len * GROUP:
            fence_async_shared()  # (the copy engine reads through the async proxy)
            gl.thread_barrier()
            box = o_smem._reinterpret(o_smem.dtype, o_desc.block_type.shape, o_desc.layout)
            tma.async_copy_shared_to_global(o_desc, [q_start + row0 // GROUP, kv_head * GROUP, 0], box)
        else:
            _store_rows(Out, o_smem, row0, q_start, q_len, kv_head, stride_ot, stride_oh, GROUP, HEAD_DIM, ROWS)
    else:
        _store_rows(Out, o_smem, row0, q_start, q_len, kv_head, stride_ot, stride_oh, GROUP, HEAD_DIM, ROWS)


@gluon.jit
def _store_rows(Out, o_smem, row0, q_start, q_len, kv_head, stride_ot, stride_oh, GROUP: gl.constexpr,
                HEAD_DIM: gl.constexpr, ROWS: gl.constexpr):
    """The output tile staged in o_smem to Out, read back in a row layout: 16-byte stores, rows past the
    sequence masked off."""
    gl.thread_barrier()
    layout: gl.constexpr = _row_layout(ROWS, HEAD_DIM, 4)
    out_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    out_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    # (over an FP8 cache the products run in fp16, and Out may be bf16)
    gl.store(Out + _row_offsets(out_rows, out_d, q_start, kv_head, stride_ot, stride_oh, GROUP),
             o_smem.load(layout).to(Out.dtype.element_ty), mask=(out_rows < q_len * GROUP)[:, None])


@gluon.jit
def _consume(Q, q_desc, Out, o_desc, q_smem, q_bars, o_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
             turn, other_turn, CuSeqlensQ, CuSeqlensK, SeqLensK, Scales, KScale, VScale, n_items, n_m, n_kv,
             sm_scale_log2, window_left, window_right, stride_qt, stride_qh, stride_ot, stride_oh,
             GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
             PAGED: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, FP8: gl.constexpr,
             FP8_CACHE: gl.constexpr, Q_BUFS: gl.constexpr, Q_TMA: gl.constexpr, O_TMA: gl.constexpr,
             WG: gl.constexpr):
    """A consumer warpgroup: rows WG * ROWS to (WG + 1) * ROWS of each of the program's work items. Its Q
    buffers are q_smem's [WG * Q_BUFS, (WG + 1) * Q_BUFS), each with its barrier in q_bars (Q_TMA): with two,
    the next item's Q is copied in while this item computes."""
    tile = 0  # key tiles consumed so far, over all of the program's items: the ring's position
    rnd = 0  # turns at the tensor cores so far (an item takes n_tiles + 1)
    j = 0  # the program's items so far
    step = gl.num_programs(0)
    if FP8_CACHE:  # q_smem is fp16; Q arrives in its own 16-bit type and is converted in place (_q_to_fp16)
        q_in = q_smem._reinterpret(Q.dtype.element_ty, q_smem.shape, q_smem.layout)
    else:
        q_in = q_smem
    if Q_BUFS == 2:
        _copy_q(q_in.index(WG * 2), q_bars.index(WG * 2), q_desc, Q, gl.program_id(0), n_m, n_kv, CuSeqlensQ,
                stride_qt, stride_qh, GROUP, HEAD_DIM, ROWS, CAUSAL, Q_TMA, WG)
    for t in range(gl.program_id(0), n_items, step):
        seq, kv_head, row0, q_start, q_len, k_start, k_len, lo, hi, n_tiles, has_rows = _work_item(
            t, n_m, n_kv, CuSeqlensQ, CuSeqlensK, SeqLensK, window_left, window_right, GROUP, 2 * ROWS, BLOCK_N,
            PAGED, CAUSAL, WINDOW, FP8)
        buf = WG * Q_BUFS + j % Q_BUFS
        if Q_BUFS == 1:
            if O_TMA:  # (and sent out)
                tma.store_wait(0)
            gl.thread_barrier()  # the previous item's output, staged in this buffer, has been read
            fence_async_shared()  # (before the copy engine writes where those reads were)
            _copy_q(q_in.index(buf), q_bars.index(buf), q_desc, Q, t, n_m, n_kv, CuSeqlensQ, stride_qt, stride_qh,
                    GROUP, HEAD_DIM, ROWS, CAUSAL, Q_TMA, WG)
        _wait_q(q_bars.index(buf), (j // Q_BUFS) & 1, Q_TMA)
        if FP8_CACHE:
            _q_to_fp16(q_in.index(buf), q_smem.index(buf), ROWS, HEAD_DIM)
        if O_TMA:  # the earlier items' output boxes have been read (this item's epilogue reuses their buffers)
            tma.store_wait(0)
        gl.thread_barrier()
        fence_async_shared()  # the tensor cores read shared memory through the async proxy
        if Q_BUFS == 2 and t + step < n_items:  # (the other buffer's last item is done: output read, products too)
            _copy_q(q_in.index(WG * 2 + (j + 1) % 2), q_bars.index(WG * 2 + (j + 1) % 2), q_desc, Q, t + step, n_m,
                    n_kv, CuSeqlensQ, stride_qt, stride_qh, GROUP, HEAD_DIM, ROWS, CAUSAL, Q_TMA, WG)
        if has_rows:
            row0 = row0 + WG * ROWS
            _attend_rows(Out, o_desc, q_smem.index(buf), o_smem.index(buf), k_smem, v_smem, k_ready, v_ready, k_empty,
                         v_empty, turn, other_turn, Scales, KScale, VScale, row0, q_start, q_len, k_len, kv_head, lo,
                         hi, n_tiles, tile, rnd, sm_scale_log2, window_left, window_right, stride_ot, stride_oh, GROUP,
                         HEAD_DIM, ROWS, BLOCK_N, PAGED, CAUSAL, WINDOW, FP8, FP8_CACHE, O_TMA, WG)
            tile += n_tiles
            rnd += n_tiles + 1
        j += 1
    tma.store_wait(0)  # (before the program's shared memory goes)


# The block table's row stride is its width, the longest sequence of the step in pages; the work items' count and
# row tiles per sequence follow the step's shape: specialised (1, a multiple of 16, other) they would compile the
# kernel again while serving, for seconds, whenever one of them changes class.
@gluon.jit(do_not_specialize=["n_items", "n_m", "stride_bt", "stride_bth"])
def _prefill_kernel(Q, q_desc, k_desc, v_desc, Out, o_desc, CuSeqlensQ, CuSeqlensK, SeqLensK, BlockTable, Scales,
                    KScale, VScale, n_items, n_m, n_kv, sm_scale_log2, window_left, window_right, stride_qt,
                    stride_qh, stride_ot, stride_oh, stride_bt, stride_bth, GROUP: gl.constexpr,
                    HEAD_DIM: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                    PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                    FP8: gl.constexpr, FP8_CACHE: gl.constexpr, TILE_LAYOUT: gl.constexpr, SLOTS8: gl.constexpr,
                    Q_BUFS: gl.constexpr, Q_TMA: gl.constexpr, O_TMA: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr):
    """Warp-specialised as in FA3: two consumer warpgroups of BLOCK_M // 2 rows each, and one producer warp (a
    warpgroup over an FP8 cache, FP8_CACHE: _load_fp8_kv). A program takes work items
    program_id, program_id + num_programs, ... (_work_item); Q_BUFS is 2 when it takes several (their Q
    double-buffered), else 1. TILE_LAYOUT: the shared layout of the Q, K and V tiles the tensor cores read;
    SLOTS8: the 8-bit tiles the copy engine fills ahead of the conversion. Q_TMA: Q's tiles come through q_desc
    (`_copy_q`); O_TMA: the outputs of whole tokens go out through o_desc."""
    ROWS: gl.constexpr = BLOCK_M // 2
    # the tensor cores' 16-bit type: the queries', or fp16 over an FP8 cache (e4m3 widens to it exactly)
    dtype: gl.constexpr = gl.float16 if FP8_CACHE else Q.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS, ROWS, HEAD_DIM], TILE_LAYOUT)
    if FP8:  # the output is 16-bit
        o_smem = gl.allocate_shared_memory(Out.dtype.element_ty, [2 * Q_BUFS, ROWS, HEAD_DIM],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16))
    else:
        o_smem = q_smem
    k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, HEAD_DIM], TILE_LAYOUT)
    if FP8:
        v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, HEAD_DIM, BLOCK_N], v_desc.layout)
    else:
        v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, HEAD_DIM], TILE_LAYOUT)
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * Q_BUFS):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival from each consumer
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)

    if FP8_CACHE:  # the copy engine's 8-bit slots, converted into the ring by the producer
        k8_smem = gl.allocate_shared_memory(k_desc.dtype, [SLOTS8, BLOCK_N, HEAD_DIM], k_desc.layout)
        v8_smem = gl.allocate_shared_memory(v_desc.dtype, [SLOTS8, BLOCK_N, HEAD_DIM], v_desc.layout)
        k8_ready = gl.allocate_shared_memory(gl.int64, [SLOTS8, 1], mbarrier.MBarrierLayout())
        v8_ready = gl.allocate_shared_memory(gl.int64, [SLOTS8, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(SLOTS8):
            mbarrier.init(k8_ready.index(i), count=1)
            mbarrier.init(v8_ready.index(i), count=1)
        producer_warps: gl.constexpr = 4
    else:  # (the 8-bit slots' names stand for nothing)
        k8_smem, v8_smem, k8_ready, v8_ready = k_smem, v_smem, k_ready, v_ready
        producer_warps: gl.constexpr = 1

    # the consumers' arguments written out twice: constexprs inside a tuple built here would turn into values
    gl.warp_specialize([
        (_consume, (Q, q_desc, Out, o_desc, q_smem, q_bars, o_smem, k_smem, v_smem, k_ready, v_ready, k_empty,
                    v_empty, turns.index(0), turns.index(1), CuSeqlensQ, CuSeqlensK, SeqLensK, Scales, KScale, VScale,
                    n_items, n_m, n_kv, sm_scale_log2, window_left, window_right, stride_qt, stride_qh, stride_ot,
                    stride_oh, GROUP, HEAD_DIM, ROWS, BLOCK_N, PAGED, CAUSAL, WINDOW, FP8, FP8_CACHE, Q_BUFS, Q_TMA,
                    O_TMA, 0)),
        (_consume, (Q, q_desc, Out, o_desc, q_smem, q_bars, o_smem, k_smem, v_smem, k_ready, v_ready, k_empty,
                    v_empty, turns.index(1), turns.index(0), CuSeqlensQ, CuSeqlensK, SeqLensK, Scales, KScale, VScale,
                    n_items, n_m, n_kv, sm_scale_log2, window_left, window_right, stride_qt, stride_qh, stride_ot,
                    stride_oh, GROUP, HEAD_DIM, ROWS, BLOCK_N, PAGED, CAUSAL, WINDOW, FP8, FP8_CACHE, Q_BUFS, Q_TMA,
                    O_TMA, 1)),
        (_produce, (k_desc, v_desc, k8_smem, v8_smem, k8_ready, v8_ready, k_smem, v_smem, k_ready, v_ready, k_empty,
                    v_empty,
                    CuSeqlensQ, CuSeqlensK, SeqLensK, BlockTable, n_items, n_m, n_kv, window_left, window_right,
                    stride_bt, stride_bth, GROUP, HEAD_DIM, ROWS, BLOCK_N, PAGED, PAGE_SIZE, CAUSAL, WINDOW, FP8,
                    FP8_CACHE)),
    ], [4, producer_warps], [CONSUMER_REGS, PRODUCER_REGS])


def default_tiles(head_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, consumer registers per thread, K slots, V slots): two consumer warpgroups of 64 rows;
    the K and V rings fill what shared memory the Q tiles leave."""
    return (128, 128, 240, 3, 3) if head_dim == 128 else (128, 128, 240, 4, 4)


def short_item_tiles(head_dim: int) -> tuple[int, int, int, int, int]:
    """The tiles of persistent programs (`short_items`), whose two Q buffers per consumer leave less room for the
    rings: at head dim 128, 128-key tiles in a K ring of 3 and a V ring of 2 (half the softmax and rescale steps of
    64-key tiles, which measured 7% slower at 16 x 1k; docs/kernel-notes.md, "Separate K and V rings"); at 64,
    64-key tiles in rings of 5."""
    return (128, 128, 240, 3, 2) if head_dim == 128 else (128, 64, 240, 5, 5)


def fp8_cache_tiles(head_dim: int, short: bool) -> tuple[int, int, int, int, int]:
    """The tiles over an FP8 cache, whose 8-bit slots take shared memory from the ring. The producer's
    conversion limits these programs, not the copies: rings of 64-key tiles with up to 4 slots copied ahead
    measured slower (docs/kernel-notes.md, "An FP8 cache in the Hopper prefill")."""
    if short:
        return (128, 64, 240, 3, 3)
    return (128, 128, 240, 2, 2) if head_dim == 128 else (128, 128, 240, 3, 3)


def short_items(max_seqlen_q: int, max_seqlen_k: int, causal: bool, items_per_sm: float) -> bool:
    """Whether a row tile sees about 768 keys or fewer on average, or up to 1,536 when there are 16 work items or
    more per SM. Then a program's fixed costs (the Q copy, the first tile's copies, the output's store) are a
    large share of its work, and persistent programs (about one per SM, each walking many work items, its producer
    copying the next item's first tiles while the consumers finish one, and their Q copied in ahead) hide them;
    with longer items, or fewer of them, the static assignment's imbalance costs more than that saves
    (docs/kernel-notes.md, "Persistent programs for short sequences" and "Persistent programs up to 1,536
    keys")."""
    keys = max_seqlen_k - max_seqlen_q / 2 if causal else max_seqlen_k
    return keys <= 768 or (keys <= 1536 and items_per_sm >= 16)


@functools.lru_cache
def persistent_programs(sms: int, n_m: int, group: int, max_seqlen_q: int, max_seqlen_k: int, block_m: int,
                        block_n: int) -> int:
    """How many persistent programs walk a causal step's work items. Round-robin hands program p the row tiles m
    of one residue class modulo gcd(programs, n_m) of every (sequence, KV head), and a row tile's key tiles grow
    with its rows' positions. One per SM, unless some class's row tiles cost more than 10% above the average
    (their key tiles, plus four tiles' worth per item for its fixed costs), as with a group of 1 or 3 at 132 SMs:
    then the most programs below that whose classes are the most even. Smaller imbalances are left alone: there
    the other count measured 2-7% slower (docs/kernel-notes.md, "Round-robin classes")."""
    cost = []
    for m in range(n_m):  # as `_work_item` counts a causal row tile's keys (rows from the last tile down)
        last_token = ((n_m - 1 - m) * block_m + block_m - 1) // group
        cost.append(triton.cdiv(min(max_seqlen_k - max_seqlen_q + last_token, max_seqlen_k - 1) + 1, block_n) + 4)

    def imbalance(programs):
        step = math.gcd(programs, n_m)
        return max(sum(cost[r::step]) / len(cost[r::step]) for r in range(step)) / (sum(cost) / n_m)
    if imbalance(sms) <= 1.1:
        return sms
    return min(range(sms - 1, sms - 9, -1), key=lambda programs: (round(imbalance(programs), 3), -programs))


@functools.lru_cache
def _sm90(device: torch.device) -> bool:
    """A Hopper GPU (wgmma and setmaxnreg are sm_90a's). Cached: it is asked on every prefill launch."""
    return torch.cuda.get_device_capability(device) == (9, 0)


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_size: int | None) -> bool:
    """Whether this kernel takes a prefill of these tensors (q [tokens, Hq, D]; k/v [tokens, Hkv, D], or paged
    caches [blocks, page, Hkv, D]): a Hopper GPU, 16-bit queries, K/V alike in their dtype or a paged FP8 (e4m3)
    cache (`prefill`'s cache_scales; an INT8 cache's per-slot scales made the conversion too slow to pay), head
    dim 64 or 128, K/V heads in contiguous rows the copy engine can read (16-byte aligned), pages of 16 keys or
    more."""
    dim = q.shape[-1]
    if q.device.type != "cuda" or not _sm90(q.device):
        return False
    fp8_cache = page_size is not None and k.dtype == v.dtype == FP8
    if q.dtype not in (torch.bfloat16, torch.float16) or not (fp8_cache or k.dtype == v.dtype == q.dtype):
        return False
    if dim not in (64, 128) or (page_size is not None and page_size < 16):
        return False
    return q.stride(-1) == 1 and all(t.stride(-1) == 1 and t.stride(-2) == dim and t.data_ptr() % 16 == 0
                                     and (t.stride(-3) * t.element_size()) % 16 == 0
                                     and (t.dim() == 3 or t.stride(0) == t.shape[1] * t.stride(1)) for t in (k, v))


_SHARED_MEMORY = 232448  # bytes a Hopper program may take
_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, FP8: gl.float8e4nv}


def _rows(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Shape and strides of t [..., tokens or page slots, H, D] seen as rows of tokens: [tokens, H * D]."""
    return [t.numel() // (t.shape[-2] * t.shape[-1]), t.shape[-2] * t.shape[-1]], [t.stride(-3), 1]


def _box_of(t: torch.Tensor, rows: int, group: int) -> TensorDescriptor | None:
    """A descriptor of t [tokens, Hq, D] whose box is a consumer's tile, rows / group tokens x a group's heads,
    or None where the copy engine cannot read it (a token's heads not adjacent, a row not 16-byte aligned)."""
    dim = t.shape[-1]
    if not (t.stride(1) == dim and t.stride(2) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0):
        return None
    box = [rows // group, group, dim]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), box,
                            gl.NVMMASharedLayout.get_default_for(box, _GLUON_DTYPES[t.dtype]))


def prefill(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seq_lens_k, block_table, max_seqlen_q, max_seqlen_k, *,
            causal, sm_scale_log2, window_size, tiles=None, programs=None, scales=None, cache_scales=None):
    """Attention of q [total_q, Hq, D] over k/v: packed [total_k, Hkv, D] with cu_seqlens_k, or paged caches
    [blocks, page, Hkv, D] with seq_lens_k and block_table ([sequences, pages], or [sequences, KV heads, pages]
    for pages chosen per KV head; max_seqlen_k: None, the table's width stands for it). Writes `out` [total_q,
    Hq, D]; `serves` must hold. `tiles` and `programs` (how many persistent programs; as many as work items: one
    each) override the choice `short_items` makes. With `scales`, the
    FP8 form (`prefill_fp8`: FP8Inputs). `cache_scales`: an FP8 paged cache's (k_scale, v_scale), one per KV
    head, as `flashpage.kv.KVCache` keeps them."""
    total_q, hq, dim = q.shape
    paged = block_table is not None
    hkv = k.shape[-2]
    batch = cu_seqlens_q.numel() - 1
    fp8_cache = scales is None and k.dtype != q.dtype
    if fp8_cache and (not paged or cache_scales is None):
        raise ValueError(f"{k.dtype} keys are read from a paged FP8 cache, with its cache_scales")
    if total_q == 0 or batch == 0:
        return out
    if paged:
        max_seqlen_k = block_table.shape[-1] * k.shape[1]
    # work items of 128 rows (every tile set's BLOCK_M) per SM, counted as if the query rows were packed: a lower
    # bound on the items that have rows, as a mixed step's decoding sequences would inflate max_seqlen_q * batch
    # (CPU tensors: the compile-only check)
    sms = sm_count(q.device) if q.is_cuda else 132
    items_per_sm = triton.cdiv(total_q * (hq // hkv), 128) * hkv / sms
    # (over an FP8 cache, whose persistent tiles are of 64 keys, the rule's first part only: its programs measured
    # 6-12% slower persistent at 1,024-1,536 keys)
    short = short_items(max_seqlen_q, max_seqlen_k, causal, 0 if fp8_cache else items_per_sm)
    block_m, block_n, regs, k_stages, v_stages = tiles or (fp8_cache_tiles(dim, short) if fp8_cache else
                                                           short_item_tiles(dim) if short else default_tiles(dim))
    # 12 warps share the register file: 2 consumer warpgroups of `regs` each and the producer's warpgroup of
    # `producer_regs` (a dequantizing producer needs a few more than one that only issues copies)
    producer_regs = 512 - 2 * regs if fp8_cache else 24
    maxnreg = (2 * regs + producer_regs) // 3 // 8 * 8
    page = k.shape[1] if paged else block_n
    if paged and page < block_n and block_n % page:
        raise ValueError(f"a key tile of {block_n} must hold whole pages of {page}")
    kv_rows = min(page, block_n)
    tile_layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], _GLUON_DTYPES[q.dtype])
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], _GLUON_DTYPES[k.dtype])
    k_desc = TensorDescriptor(k, *_rows(k), [kv_rows, dim], kv_layout)
    if scales is None:
        v_desc = TensorDescriptor(v, *_rows(v), [kv_rows, dim], kv_layout)
    else:  # Vᵀ [Hkv, D, keys] as rows (KV head, d) of keys
        v_rows = v.view(hkv * dim, v.shape[-1])
        v_desc = TensorDescriptor(v_rows, list(v_rows.shape), [v_rows.stride(0), 1], [dim, block_n],
                                  gl.NVMMASharedLayout.get_default_for([dim, block_n], _GLUON_DTYPES[v.dtype]))
    # Q through the copy engine where a consumer's rows are whole tokens' groups of heads (`_box_of`); the output
    # likewise, from its 16-bit tile in Q's place (the FP8 forms, whose tiles are laid out otherwise, keep the row
    # stores: not measured on a GPU with the box)
    group, rows = hq // hkv, block_m // 2
    q_desc = _box_of(q, rows, group) if rows % group == 0 else None
    o_desc = None
    if q_desc is not None and scales is None and not fp8_cache and out.dtype == q.dtype:
        o_desc = _box_of(out, rows, group)
    q_tma, o_tma = q_desc is not None, o_desc is not None
    unused = cu_seqlens_q
    k_scale, v_scale = cache_scales if fp8_cache else (unused, unused)
    n_m = triton.cdiv(max_seqlen_q * (hq // hkv), block_m)
    n_items = n_m * hkv * batch
    if not programs:
        programs = n_items
        if short:
            programs = (persistent_programs(sms, n_m, hq // hkv, max_seqlen_q, max_seqlen_k, block_m, block_n)
                        if causal else sms)
    programs = min(n_items, programs)
    q_bufs = 2 if programs < n_items else 1
    # an FP8 cache's copies run as far ahead as the shared memory the Q tiles and the ring leave allows, up to 4
    # tiles (a few hundred bytes stay for the barriers)
    left = _SHARED_MEMORY - 2 * q_bufs * block_m // 2 * dim * 2 - (k_stages + v_stages) * block_n * dim * 2 - 1024
    slots8 = min(4, left // (2 * block_n * dim)) if fp8_cache else 1
    if fp8_cache and slots8 < 2:
        raise ValueError(f"tiles {(block_m, block_n, regs, k_stages, v_stages)} leave no room for the FP8 cache's "
                         "copies")
    _prefill_kernel[(programs, )](
        q, q_desc, k_desc, v_desc, out, o_desc, cu_seqlens_q, unused if paged else cu_seqlens_k,
        unused if seq_lens_k is None else seq_lens_k, block_table if paged else unused,
        unused if scales is None else scales, k_scale, v_scale, n_items, n_m, hkv, sm_scale_log2, window_size[0],
        window_size[1], q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0) if paged else 0, head_stride(block_table) if paged else 0,
        GROUP=hq // hkv, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, K_STAGES=k_stages, V_STAGES=v_stages,
        PAGED=paged, PAGE_SIZE=page, CAUSAL=causal, WINDOW=tuple(window_size) != (-1, -1),
        FP8=scales is not None, FP8_CACHE=fp8_cache,
        TILE_LAYOUT=tile_layout, SLOTS8=slots8, Q_BUFS=q_bufs, Q_TMA=q_tma, O_TMA=o_tma, CONSUMER_REGS=regs,
        PRODUCER_REGS=producer_regs, num_warps=4, maxnreg=maxnreg)
    return out


@dataclass
class FP8Inputs:
    """Attention inputs in the layout `prefill`'s FP8 form reads (`quantize_inputs`): q e4m3 [tokens, Hq, D]; k e4m3
    [slots, Hkv, D] and v_t, Vᵀ e4m3 [Hkv, D, slots], each sequence's keys from slot cu_seqlens_k[i], a multiple of
    16 (a copy-engine tile of Vᵀ must start 16-byte aligned; the slots between sequences hold zeros), seq_lens_k[i]
    of them; scales [Hkv, group + 2]: per KV head, its query heads' scales, then its K and V scales."""
    q: torch.Tensor
    k: torch.Tensor
    v_t: torch.Tensor
    scales: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seq_lens_k: torch.Tensor


def quantize_inputs(q, k, v, cu_seqlens_k) -> FP8Inputs:
    """Packed 16-bit q [tokens, Hq, D], k/v [keys, Hkv, D] quantized with one scale per head, in one pass each, to
    the layout of FP8Inputs (with no host sync: the slots are sized for the most padding the batch can need)."""
    hq, hkv, dim = q.shape[1], k.shape[1], q.shape[2]
    batch, keys = cu_seqlens_k.numel() - 1, k.shape[0]
    lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    cu_aligned = torch.zeros_like(cu_seqlens_k)
    torch.cumsum((lens + 15) // 16 * 16, 0, out=cu_aligned[1:])
    slot = torch.arange(keys, device=k.device) + torch.repeat_interleave(cu_aligned[:-1] - cu_seqlens_k[:-1], lens,
                                                                           output_size=keys)
    slots = triton.cdiv(keys, 16) * 16 + 16 * batch  # (Vᵀ's rows 16-byte aligned too)
    q8, q_scale = quantize_heads(q)
    k8, k_scale = quantize_heads(k, torch.zeros(slots, hkv, dim, dtype=FP8, device=k.device), slot)
    v_t = torch.zeros(hkv, dim, slots, dtype=FP8, device=v.device)  # zeros: P V multiplies the padding by 0
    _, v_scale = quantize_heads(v, v_t.permute(2, 0, 1), slot)
    scales = torch.cat([q_scale.view(hkv, hq // hkv), k_scale[:, None], v_scale[:, None]], 1).contiguous()
    return FP8Inputs(q8, k8, v_t, scales, cu_aligned, lens)


def prefill_fp8(x: FP8Inputs, out, cu_seqlens_q, max_seqlen_q, max_seqlen_k, *, causal, sm_scale_log2, window_size,
                tiles=None, programs=None):
    """`prefill` on FP8 tensor cores: both products multiply e4m3 values; P is rounded to e4m3 as FA3 does, and
    the scales fold into the softmax's and the output's. V comes transposed, keys contiguous, as FP8's P V reads
    it."""
    return prefill(x.q, x.k, x.v_t, out, cu_seqlens_q, x.cu_seqlens_k, x.seq_lens_k, None, max_seqlen_q,
                   max_seqlen_k, causal=causal, sm_scale_log2=sm_scale_log2, window_size=window_size, tiles=tiles,
                   programs=programs, scales=x.scales)
