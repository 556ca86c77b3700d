"""Rotary position embedding on Q and K (rotate-half layout), fused with writing K and V into the paged cache.

One program per token rotates all its query and key heads in place; with a cache it also stores the rotated
key and the value at the token's slot (slot -1: padding, not stored). An FP8 cache that keeps its keys rotated
(`KVCache.keys_rotated`) gets queries and keys multiplied by `reference.key_rotation` after the rotary embedding,
two tokens a program. While the programs are few, a second one beside each does the keys and the cache write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels import pdl
from flashpage.kernels.attention import tile_dot
from flashpage.kernels.cache import cache_scale, scale_pointers, to_cache_dtype
from flashpage.kernels.device import interpreting
from flashpage.kernels.pdl import release_next, wait_for_previous


@triton.jit
def _key_rotation(y1, y2, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK: tl.constexpr,
                  LOG2_BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    """[y1 y2] times reference.key_rotation: ([y1 H + y2 H], [y1 H - y2 H]) / sqrt(2 * BLOCK), H block-diagonal
    with Hadamard blocks of BLOCK (entry (i, j) of a block: -1 to the number of bits i and j share). The
    products by +-1 are exact in the model dtype and summed in float32; the result is rounded once."""
    i = tl.arange(0, BLOCK_HALF)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    shared = (i % BLOCK) & (j % BLOCK)
    parity = shared * 0
    for b in tl.static_range(LOG2_BLOCK):
        parity ^= (shared >> b) & 1
    ty = y1.dtype
    # (by way of float32: the interpreter converts integers to bf16 wrongly)
    h = tl.where((i // BLOCK == j // BLOCK) & (i < HALF) & (j < HALF), 1.0 - 2.0 * parity, 0.0).to(ty)
    a, b = tile_dot(y1, h, UPCAST), tile_dot(y2, h, UPCAST)
    return ((a + b) * (2.0 * BLOCK) ** -0.5).to(ty), ((a - b) * (2.0 * BLOCK) ** -0.5).to(ty)


@triton.jit
def _rotate(X, stride_t, stride_h, Cos, Sin, stride_ct, t0, num_tokens, heads, HALF: tl.constexpr,
            TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, ROTATE_KEYS: tl.constexpr,
            BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    """Rotate the heads [heads, 2 * HALF] of tokens t0 .. t0 + TOKENS - 1 at X in place, one row per (token,
    head); returns the rotated halves for the cache, with each row's token and which rows are real."""
    row = tl.arange(0, TOKENS * BLOCK_H)[:, None]
    if TOKENS > 1:
        t = t0 + row // BLOCK_H
    else:  # one token: its cos and sin read once, not once per head
        t = t0 + tl.zeros([1, 1], tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (t < num_tokens) & (row % BLOCK_H < heads) & (d < HALF)
    x = X + t * stride_t + (row % BLOCK_H) * stride_h + d
    x1 = tl.load(x, mask=ok, other=0.0)
    x2 = tl.load(x + HALF, mask=ok, other=0.0)
    c = t * stride_ct + d
    cos1 = tl.load(Cos + c, mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(Cos + c + HALF, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + c, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(Sin + c + HALF, mask=ok, other=0.0).to(tl.float32)
    ty = x1.dtype
    # x * cos + rotate_half(x) * sin, each product rounded to the model dtype like the unfused model.
    y1 = ((x1.to(tl.float32) * cos1).to(ty).to(tl.float32) - (x2.to(tl.float32) * sin1).to(ty).to(tl.float32)).to(ty)
    y2 = ((x2.to(tl.float32) * cos2).to(ty).to(tl.float32) + (x1.to(tl.float32) * sin2).to(ty).to(tl.float32)).to(ty)
    if ROTATE_KEYS:
        y1, y2 = _key_rotation(y1, y2, HALF, BLOCK_HALF, BLOCK, LOG2_BLOCK, UPCAST)
    tl.store(x, y1, mask=ok)
    tl.store(x + HALF, y2, mask=ok)
    return y1, y2, t, ok


@triton.jit
def _rope_and_cache_kernel(Q, K, V, Cos, Sin, KCache, VCache, KScale, VScale, SlotMapping, stride_qt, stride_qh,
                           stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_cb, stride_cs, stride_ch,
                           num_tokens, q_heads, kv_heads,
                           HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, WRITE_CACHE: tl.constexpr,
                           BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                           TOKENS: tl.constexpr, ROTATE_KEYS: tl.constexpr, BLOCK: tl.constexpr,
                           LOG2_BLOCK: tl.constexpr, UPCAST: tl.constexpr, KEYS_PROGRAM: tl.constexpr,
                           PDL: tl.constexpr):
    """Program (i, 0) rotates tokens i * TOKENS .. of Q, program (i, KEYS_PROGRAM) those of K and writes the cache
    (KEYS_PROGRAM 1: side by side, 0: one after the other in one program)."""
    wait_for_previous(PDL)
    release_next(PDL)
    t0 = tl.program_id(0).to(tl.int64) * TOKENS
    if tl.program_id(1) == 0:
        _rotate(Q, stride_qt, stride_qh, Cos, Sin, stride_ct, t0, num_tokens, q_heads, HALF, TOKENS, BLOCK_HQ,
                BLOCK_HALF, ROTATE_KEYS, BLOCK, LOG2_BLOCK, UPCAST)
    if tl.program_id(1) == KEYS_PROGRAM:
        k1, k2, t, ok = _rotate(K, stride_kt, stride_kh, Cos, Sin, stride_ct, t0, num_tokens, kv_heads, HALF, TOKENS,
                                BLOCK_HK, BLOCK_HALF, ROTATE_KEYS, BLOCK, LOG2_BLOCK, UPCAST)
        if WRITE_CACHE:
            slot = tl.load(SlotMapping + t, mask=t < num_tokens, other=-1).to(tl.int64)  # [rows, 1]; -1: not stored
            h = tl.arange(0, TOKENS * BLOCK_HK)[:, None] % BLOCK_HK
            d = tl.arange(0, BLOCK_HALF)[None, :]
            ok = ok & (slot >= 0)
            dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs + h * stride_ch + d
            k_scale = cache_scale(KCache, KScale, slot, h, kv_heads, PAGE_SIZE, k1, k2)
            tl.store(KCache + dst, to_cache_dtype(k1, k_scale, KCache), mask=ok)
            tl.store(KCache + dst + HALF, to_cache_dtype(k2, k_scale, KCache), mask=ok)
            v = V + t * stride_vt + h * stride_vh + d
            v1, v2 = tl.load(v, mask=ok, other=0.0), tl.load(v + HALF, mask=ok, other=0.0)
            v_scale = cache_scale(VCache, VScale, slot, h, kv_heads, PAGE_SIZE, v1, v2)
            tl.store(VCache + dst, to_cache_dtype(v1, v_scale, VCache), mask=ok)
            tl.store(VCache + dst + HALF, to_cache_dtype(v2, v_scale, VCache), mask=ok)


def rope_and_cache(q, k, cos, sin, v=None, kv_cache=None, slot_mapping=None):
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos/sin [T, D]; with a cache (a KVCache), also store k
    and v [T, Hkv, D] at slot_mapping [T] of its k/v [num_blocks, block_size, Hkv, D]. Returns (q, k)."""
    t, hq, dim = q.shape
    hkv = k.shape[1]
    if k.shape[0] != t or k.shape[2] != dim or cos.shape != (t, dim) or sin.shape != cos.shape or dim % 2:
        raise ValueError(f"rope_and_cache: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do not fit")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope_and_cache needs unit-stride head dims and cos/sin of one layout")
    write = kv_cache is not None
    k_cache, v_cache = (kv_cache.k, kv_cache.v) if write else (None, None)
    if write and (k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape or v.shape != k.shape
                  or v.stride(-1) != 1):
        raise ValueError(f"k/v {tuple(k.shape)} do not fit caches {tuple(k_cache.shape)}")
    if t == 0:
        return q, k
    v, kc, vc, sm = (v, k_cache, v_cache, slot_mapping) if write else (k, k, k, k)
    ks, vs = scale_pointers(kv_cache) if write else (k, k)
    half = dim // 2
    rotate = write and kv_cache.keys_rotated
    # the rotation multiplies tiles (tl.dot: 16 rows and columns at least), two tokens' heads at a time (the
    # fastest on an H200 from 1 to 16k tokens, docs/kernel-notes.md)
    tokens = 2 if rotate else 1
    least = 16 if rotate else 1
    heads_least = -(-least // tokens)  # rows a token's heads take at least
    block = half & -half  # the rotation's Hadamard blocks: the largest power of two dividing half
    programs = triton.cdiv(t, tokens)
    # queries and keys in programs side by side while they are few (an H200: at 1-4k tokens faster, at 16k slower)
    split = programs <= 2048
    early = pdl.enabled(q.device)
    _rope_and_cache_kernel[(programs, 2 if split else 1)](
        q, k, v, cos, sin, kc, vc, ks, vs, sm, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), kc.stride(0) if write else 0, kc.stride(1) if write else 0, kc.stride(2) if write else 0,
        t, hq, hkv, HALF=half, PAGE_SIZE=kc.shape[1] if write else 1, WRITE_CACHE=write,
        BLOCK_HQ=max(heads_least, triton.next_power_of_2(hq)), BLOCK_HK=max(heads_least, triton.next_power_of_2(hkv)),
        BLOCK_HALF=max(least, triton.next_power_of_2(half)), TOKENS=tokens, ROTATE_KEYS=rotate, BLOCK=block,
        LOG2_BLOCK=block.bit_length() - 1,
        UPCAST=rotate and q.dtype == torch.bfloat16 and interpreting(),
        KEYS_PROGRAM=int(split), PDL=early, launch_pdl=early)
    return q, k
