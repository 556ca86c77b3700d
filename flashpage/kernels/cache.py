"""Writing new tokens' K and V into their slots of the paged cache, in its dtype (`flashpage.kv.cache`): an FP8 cache
divides by its per-head scale and saturates at e4m3's largest value; an INT8 cache gives each (token, head) the
scale largest magnitude / 127 and rounds to nearest, as `reference.quantize_for_cache` (Triton's float32 division
is not IEEE-exact: a value can land one step away)."""

from __future__ import annotations

import triton
import triton.language as tl

from flashpage.kernels.quantize import to_e4m3


@triton.jit
def _reshape_and_cache_kernel(K, V, KCache, VCache, KScale, VScale, SlotMapping, stride_kt, stride_kh, stride_vt,
                              stride_vh, stride_cb, stride_ct, stride_ch, PAGE_SIZE: tl.constexpr,
                              HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < HEADS) & (d < HEAD_DIM)
    dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_ct + h * stride_ch + d
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=ok, other=0.0)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=ok, other=0.0)
    k_scale = cache_scale(KCache, KScale, slot, h, HEADS, PAGE_SIZE, k, k)
    v_scale = cache_scale(VCache, VScale, slot, h, HEADS, PAGE_SIZE, v, v)
    tl.store(KCache + dst, to_cache_dtype(k, k_scale, KCache), mask=ok)
    tl.store(VCache + dst, to_cache_dtype(v, v_scale, VCache), mask=ok)


@triton.jit
def cache_scale(Cache, Scale, slot, h, HEADS, PAGE_SIZE: tl.constexpr, x1, x2):
    """The scales [R, 1] by which rows [R, D] (heads h [R, 1], given as two column halves x1, x2; or x twice) are
    stored at `slot` (one, or one per row; -1: not stored): an INT8 cache's new ones (written to Scale [blocks,
    HEADS, PAGE_SIZE]), an FP8 cache's per-head ones; 1 otherwise."""
    ty = Cache.dtype.element_ty
    if ty == tl.int8:
        largest = tl.maximum(tl.max(tl.abs(x1.to(tl.float32)), 1), tl.max(tl.abs(x2.to(tl.float32)), 1))[:, None]
        scale = tl.where(largest > 0, largest / 127.0, 1.0)
        tl.store(Scale + ((slot // PAGE_SIZE) * HEADS + h) * PAGE_SIZE + slot % PAGE_SIZE, scale,
                 mask=(h < HEADS) & (slot >= 0))
    elif ty == tl.float8e4nv:
        scale = tl.load(Scale + h, mask=h < HEADS, other=1.0)
    else:
        scale = h * 0.0 + 1.0
    return scale


@triton.jit
def to_cache_dtype(x, scale, Cache):
    """x as the cache stores it, divided by `scale` (from cache_scale)."""
    ty = Cache.dtype.element_ty
    if ty == tl.float8e4nv:
        return to_e4m3(x.to(tl.float32) / scale)
    if ty == tl.int8:
        x = tl.minimum(tl.maximum(tl.floor(x.to(tl.float32) / scale + 0.5), -127.0), 127.0)
    return x.to(ty)


def scale_pointers(kv_cache):
    """The cache's scale tensors for a kernel launch (its K cache, unread, where it has none)."""
    if kv_cache.k_scale is None:
        return kv_cache.k, kv_cache.k
    return kv_cache.k_scale, kv_cache.v_scale


def reshape_and_cache(k, v, kv_cache, slot_mapping) -> None:
    """k/v [T, Hkv, D] -> a KVCache's k/v [num_blocks, block_size, Hkv, D] at slot_mapping [T] (slot -1 skipped)."""
    k_cache, v_cache = kv_cache.k, kv_cache.v
    if k.shape[0] == 0:
        return
    if k.shape[1:] != k_cache.shape[2:] or k_cache.shape != v_cache.shape or k.stride(-1) != 1:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit caches {tuple(k_cache.shape)}")
    heads, dim = k.shape[1], k.shape[2]
    _reshape_and_cache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, *scale_pointers(kv_cache), slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), PAGE_SIZE=k_cache.shape[1],
        HEADS=heads, HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim))
