"""The prefill attention as the engine calls it on a Hopper GPU (there, the Gluon kernel of
`flashpage.kernels.hopper_prefill`; head dims it does not take go to the portable kernel, checked here too).

FlashAttention's acceptance rule: the largest error against a float32 reference is at most twice that of the same
math done in the inputs' 16-bit dtype. Runs only on a CUDA GPU of compute capability 9.0; on CPU the Gluon kernel
is compiled for sm_90 by tests/compile_for_hopper.py instead.
"""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels import hopper_prefill
from flashpage.kernels.reference import quantize_for_cache, read_pages
from flashpage.kernels.triton_ops import flash_attn_varlen, paged_attention
from flashpage.kv import KVCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="the Hopper prefill runs on an sm_90 GPU")


def reference(q, k, v, causal, window, dtype):
    """One sequence, its queries the last q_len of its keys: q [ql, Hq, D], k/v [kl, Hkv, D], in `dtype` math."""
    ql, hq, dim = q.shape
    kl, hkv = k.shape[:2]
    out = torch.zeros(ql, hq, dim, device=q.device)
    if ql == 0:
        return out
    q_pos = torch.arange(kl - ql, kl, device=q.device)[:, None]
    k_pos = torch.arange(kl, device=q.device)[None, :]
    visible = torch.ones(ql, kl, dtype=torch.bool, device=q.device)
    if causal:
        visible &= k_pos <= q_pos
    if window[0] >= 0:
        visible &= k_pos >= q_pos - window[0]
    if window[1] >= 0:
        visible &= k_pos <= q_pos + window[1]
    for h in range(0, hq, 4):  # a few heads at a time: a 32k x 32k float32 score matrix per head
        heads = list(range(h, min(h + 4, hq)))
        kv = [i * hkv // hq for i in heads]
        qq, kk, vv = (x.to(dtype).transpose(0, 1) for x in (q[:, heads], k[:, kv], v[:, kv]))
        s = (qq @ kk.transpose(1, 2) * dim**-0.5).masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out[:, heads] = (p.to(dtype) @ vv).float().transpose(0, 1)
    return out


def quantize(cache, cache_dtype):
    """An 8-bit copy of a paged cache [blocks, page, Hkv, D] (NaN in its unused slots), stored as the cache writer
    stores it (`quantize_for_cache`): FP8 with a scale per KV head, INT8 with one per slot and KV head ([blocks, Hkv,
    page]; NaN where the slot is unused)."""
    flat = cache.flatten(0, 1)
    if cache_dtype == torch.float8_e4m3fn:
        amax = cache.nan_to_num(0).abs().amax((0, 1, 3)).float()
        scale = amax / 448 * torch.empty_like(amax).uniform_(1, 2)  # some heads' values short of the range
        return quantize_for_cache(flat, cache_dtype, scale)[0].view_as(cache), scale
    values, scale = quantize_for_cache(flat.nan_to_num(0), cache_dtype)
    scale = scale.masked_fill(flat.isnan().any(-1), float("nan")).view(cache.shape[:3])
    return values.view_as(cache), scale.transpose(1, 2).contiguous()


def check(q_lens, k_lens, hq, hkv, dim, *, causal=True, window=(-1, -1), page=None, dtype=torch.bfloat16,
          cache_dtype=None):
    """Random inputs through the engine's prefill entry points, compared to `reference`. `cache_dtype`: an 8-bit
    paged cache (the reference then attends over its dequantized values)."""
    qs = [torch.randn(n, hq, dim, device="cuda", dtype=dtype) for n in q_lens]
    ks = [torch.randn(n, hkv, dim, device="cuda", dtype=dtype) for n in k_lens]
    vs = [torch.randn(n, hkv, dim, device="cuda", dtype=dtype) for n in k_lens]
    q = torch.cat(qs)
    cu_q = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
    if page is None:
        k, v = torch.cat(ks), torch.cat(vs)
        cu_k = torch.tensor([0] + k_lens, device="cuda").cumsum(0).int()
        served = hopper_prefill.serves(q, k, v, None)
        flash_attn_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal, window_size=window, out=out)
    else:  # each sequence's pages shuffled through a cache whose other slots hold NaN
        pages = [-(-n // page) for n in k_lens]
        k_cache = torch.full((sum(pages) + 3, page, hkv, dim), float("nan"), device="cuda", dtype=dtype)
        v_cache = k_cache.clone()
        order = torch.randperm(k_cache.shape[0], device="cuda")
        # as wide as the longest sequence needs, and -1 past each one's pages: a tile's pages past the end must
        # not be read from the table
        table = torch.full((len(k_lens), max(pages)), -1, dtype=torch.int32, device="cuda")
        used = 0
        for i, n in enumerate(k_lens):
            blocks = order[used:used + pages[i]]
            used += pages[i]
            table[i, :pages[i]] = blocks
            for j, b in enumerate(blocks.tolist()):
                rows = slice(j * page, min((j + 1) * page, n))
                k_cache[b, :rows.stop - rows.start] = ks[i][rows]
                v_cache[b, :rows.stop - rows.start] = vs[i][rows]
        cache = KVCache(k_cache, v_cache)
        if cache_dtype is not None:
            (k8, k_scale), (v8, v_scale) = quantize(k_cache, cache_dtype), quantize(v_cache, cache_dtype)
            cache = KVCache(k8, v8, k_scale, v_scale)
            for i, n in enumerate(k_lens):
                k_deq, v_deq = read_pages(cache, table[i, :pages[i]], torch.float32)
                ks[i], vs[i] = k_deq.flatten(0, 1)[:n].to(dtype), v_deq.flatten(0, 1)[:n].to(dtype)
        served = hopper_prefill.serves(q, cache.k, cache.v, page)
        paged_attention(q, cache, table, cu_q, torch.tensor(k_lens, device="cuda").int(), max(q_lens),
                        causal=causal, window_size=window, out=out)
    ref = torch.cat([reference(qs[i], ks[i], vs[i], causal, window, torch.float32) for i in range(len(q_lens))])
    low = torch.cat([reference(qs[i], ks[i], vs[i], causal, window, dtype) for i in range(len(q_lens))])
    assert not out.isnan().any()
    err, bound = (out.float() - ref).abs().max().item(), (low - ref).abs().max().item()
    assert err <= 2 * bound, f"max error {err:.3g} against float32; the same math in {dtype}: {bound:.3g}"
    return served


@pytest.mark.parametrize("dim", [64, 96, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 8), (28, 4), (32, 4), (16, 1)])  # GQA 1, 4, 7, 8, 16
def test_varlen_and_paged_prefill(dim, hq, hkv):
    served = check([1, 17, 300, 1000], [1, 17, 300, 1000], hq, hkv, dim)
    assert served == (dim in (64, 128))  # other head dims take the portable kernel
    for page in (16, 64):  # chunks at the end of their sequences, a sequence with no query in the batch
        check([0, 1000, 700, 17, 1], [40, 1000, 3000, 17, 33], hq, hkv, dim, page=page)
        check([0, 300, 17, 1], [40, 300, 17, 33], hq, hkv, dim, page=page)  # short: persistent programs


def test_short_and_long_items_take_their_own_schedules():
    """The checks above cover both schedules only if the rule splits them as they assume."""
    assert hopper_prefill.short_items(1000, 1000, True, 1) and hopper_prefill.short_items(300, 320, True, 1)
    assert not hopper_prefill.short_items(1000, 3008, True, 1) and not hopper_prefill.short_items(800, 800, False, 1)
    # up to 1,536 keys with 16 items per SM or more
    assert hopper_prefill.short_items(2048, 2048, True, 16) and not hopper_prefill.short_items(2048, 2048, True, 4)
    assert not hopper_prefill.short_items(1024, 3072, True, 64)


@pytest.mark.parametrize("dim", [64, 128])
def test_windows_and_non_causal(dim):
    check([1, 17, 300, 1000], [1, 17, 300, 1000], 32, 8, dim, window=(64, 0))
    check([5, 300, 900], [5, 300, 900], 32, 8, dim, causal=False)
    check([5, 300, 700], [5, 300, 700], 32, 8, dim, causal=False, window=(100, 30))
    check([0, 500, 129], [40, 1500, 129], 28, 4, dim, window=(200, 0), page=16)


def test_fp16_and_long_sequences():
    check([1, 300, 1000], [1, 300, 1000], 32, 8, 128, dtype=torch.float16)
    check([1, 300, 1000], [10, 800, 1000], 32, 8, 64, page=16, dtype=torch.float16)
    assert check([16384], [16384], 32, 8, 128)
    assert check([8192], [32768], 32, 8, 128, page=16)
    assert check([8192], [32768], 32, 8, 128, page=16, cache_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("dim", [64, 96, 128])
def test_quantized_cache(dim, cache_dtype):
    """A prefill over an FP8 or INT8 cache: the Gluon kernel's producer converts an FP8 cache's tiles (head dims
    64 and 128), the portable kernel takes the others; chunks at the end of their sequences, short and long items,
    a window."""
    for hq, hkv in ((32, 8), (28, 4)):
        served = check([0, 1000, 700, 17, 1], [40, 1000, 3000, 17, 33], hq, hkv, dim, page=16,
                       cache_dtype=cache_dtype)
        assert served == (dim in (64, 128) and cache_dtype == torch.float8_e4m3fn)
        check([0, 300, 17, 1], [40, 300, 17, 33], hq, hkv, dim, page=16, cache_dtype=cache_dtype)
        check([0, 500, 129], [40, 1500, 129], hq, hkv, dim, window=(200, 0), page=64, cache_dtype=cache_dtype)
    check([1, 300, 1000], [10, 800, 1000], 32, 8, dim, page=16, dtype=torch.float16, cache_dtype=cache_dtype)


def test_fp8_cache_clamps_queries_to_fp16():
    """The Gluon prefill over an FP8 cache multiplies in fp16: a query past its range is clamped (as the decode
    does), so its row stays finite; unclamped it becomes inf and its scores NaN."""
    k_cache = torch.randn(20, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    (k8, k_scale), (v8, v_scale) = quantize(k_cache, torch.float8_e4m3fn), quantize(torch.randn_like(k_cache),
                                                                                    torch.float8_e4m3fn)
    cache = KVCache(k8, v8, k_scale, v_scale)
    q = torch.randn(300, 32, 128, device="cuda", dtype=torch.bfloat16)
    q[7, 3, :5] = 1e6
    table = torch.randperm(20, device="cuda", dtype=torch.int32)[None]
    cu_q = torch.tensor([0, 300], device="cuda", dtype=torch.int32)
    assert hopper_prefill.serves(q, cache.k, cache.v, 16)
    out = paged_attention(q, cache, table, cu_q, torch.tensor([320], device="cuda", dtype=torch.int32), 300,
                          out=torch.full_like(q, float("nan")))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dim", [64, 128])
def test_fp8_prefill(dim):
    """FP8 (e4m3) prefill on FP8 tensor cores: against float32 math on the same quantized values its error is P's
    rounding to e4m3; against the 16-bit inputs, what README reports."""
    from flashpage.kernels.fp8 import dequantize_heads, quantize_heads
    lens = [1, 17, 300, 1000, 2100]
    q = torch.randn(sum(lens), 32, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), 8, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).int()
    assert hopper_prefill.serves(q, k, v, None)
    for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (100, 0))):
        out = flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal, window_size=window, fp8=True,
                                out=torch.full_like(q, float("nan")))
        deq = [dequantize_heads(*quantize_heads(t), torch.float32) for t in (q, k, v)]
        spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        ref = torch.cat([reference(*(t[a:b] for t in deq), causal, window, torch.float32) for a, b in spans])
        exact = torch.cat([reference(q[a:b], k[a:b], v[a:b], causal, window, torch.float32) for a, b in spans])
        err, err_inputs = (((out.float() - r).norm() / r.norm()).item() for r in (ref, exact))
        print(f"fp8 d={dim} causal={causal} window={window}: {err:.2e} against the quantized values' float32 "
              f"math, {err_inputs:.2e} against the bf16 inputs'")
        assert not out.isnan().any() and err < 0.03 and err_inputs < 0.06

