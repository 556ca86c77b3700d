"""reshape_and_cache: write the new tokens' K and V into their slots of the paged cache (in its dtype: an FP8 cache
saturates at e4m3's largest value, as `reference.to_cache_dtype`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(K, V, KCache, VCache, SlotMapping, stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_cb, stride_ct, stride_ch, PAGE_SIZE: tl.constexpr, HEADS: tl.constexpr,
                              HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < HEADS) & (d < HEAD_DIM)
    dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_ct + h * stride_ch + d
    tl.store(KCache + dst, to_cache_dtype(tl.load(K + t * stride_kt + h * stride_kh + d, mask=ok), KCache), mask=ok)
    tl.store(VCache + dst, to_cache_dtype(tl.load(V + t * stride_vt + h * stride_vh + d, mask=ok), VCache), mask=ok)


@triton.jit
def to_cache_dtype(x, Cache):
    """x as the cache stores it: an FP8 cache saturates at e4m3's largest value instead of overflowing to NaN."""
    if Cache.dtype.element_ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(Cache.dtype.element_ty)


def reshape_and_cache(k, v, kv_cache, slot_mapping) -> None:
    """k/v [T, Hkv, D] -> a KVCache's k/v [num_blocks, block_size, Hkv, D] at slot_mapping [T] (slot -1 skipped)."""
    k_cache, v_cache = kv_cache.k, kv_cache.v
    if k.shape[0] == 0:
        return
    if k.shape[1:] != k_cache.shape[2:] or k_cache.shape != v_cache.shape or k.stride(-1) != 1:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit caches {tuple(k_cache.shape)}")
    heads, dim = k.shape[1], k.shape[2]
    _reshape_and_cache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), PAGE_SIZE=k_cache.shape[1], HEADS=heads,
        HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim))
