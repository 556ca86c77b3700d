"""Rotary position embedding on Q and K (rotate-half layout), fused with writing K and V into the paged cache.

One program per token rotates all its query and key heads in place; with a cache it also stores the rotated
key and the value at the token's slot (slot -1: padding, not stored).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashpage.kernels.cache import cache_scale, scale_pointers, to_cache_dtype


@triton.jit
def _rotate(X, stride_h, heads, cos1, sin1, cos2, sin2, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_HALF: tl.constexpr):
    """Rotate heads [heads, 2 * HALF] at X in place; returns the rotated halves for the cache."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (h < heads) & (d < HALF)
    x1 = tl.load(X + h * stride_h + d, mask=ok, other=0.0)
    x2 = tl.load(X + h * stride_h + HALF + d, mask=ok, other=0.0)
    ty = x1.dtype
    # x * cos + rotate_half(x) * sin, each product rounded to the model dtype like the unfused model.
    y1 = ((x1.to(tl.float32) * cos1).to(ty).to(tl.float32) - (x2.to(tl.float32) * sin1).to(ty).to(tl.float32)).to(ty)
    y2 = ((x2.to(tl.float32) * cos2).to(ty).to(tl.float32) + (x1.to(tl.float32) * sin2).to(ty).to(tl.float32)).to(ty)
    tl.store(X + h * stride_h + d, y1, mask=ok)
    tl.store(X + h * stride_h + HALF + d, y2, mask=ok)
    return y1, y2


@triton.jit
def _rope_and_cache_kernel(Q, K, V, Cos, Sin, KCache, VCache, KScale, VScale, SlotMapping, stride_qt, stride_qh,
                           stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_cb, stride_cs, stride_ch,
                           q_heads, kv_heads,
                           HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, WRITE_CACHE: tl.constexpr,
                           BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dok = d < HALF
    cos1 = tl.load(Cos + t * stride_ct + d, mask=dok, other=0.0).to(tl.float32)
    cos2 = tl.load(Cos + t * stride_ct + HALF + d, mask=dok, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + t * stride_ct + d, mask=dok, other=0.0).to(tl.float32)
    sin2 = tl.load(Sin + t * stride_ct + HALF + d, mask=dok, other=0.0).to(tl.float32)
    _rotate(Q + t * stride_qt, stride_qh, q_heads, cos1, sin1, cos2, sin2, HALF, BLOCK_HQ, BLOCK_HALF)
    k1, k2 = _rotate(K + t * stride_kt, stride_kh, kv_heads, cos1, sin1, cos2, sin2, HALF, BLOCK_HK, BLOCK_HALF)
    if WRITE_CACHE:
        slot = tl.load(SlotMapping + t).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, BLOCK_HK)[:, None]
            ok = (h < kv_heads) & dok
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
    _rope_and_cache_kernel[(t,)](
        q, k, v, cos, sin, kc, vc, ks, vs, sm, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), kc.stride(0) if write else 0, kc.stride(1) if write else 0, kc.stride(2) if write else 0,
        hq, hkv, HALF=half, PAGE_SIZE=kc.shape[1] if write else 1, WRITE_CACHE=write,
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hkv),
        BLOCK_HALF=triton.next_power_of_2(half))
    return q, k
