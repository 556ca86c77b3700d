"""Compile every Triton kernel for a Hopper GPU (sm_90, down to the cubin), on a machine without one.

The CPU interpreter that runs the kernel tests accepts code that the GPU compiler rejects (a plain global used
inside a kernel, a name given two types on the two sides of a runtime `if`), so a kernel can pass every test here
and fail on its first GPU launch. This script swaps in a driver that answers the compiler's questions as an H100
would and turns every launch into a compile only, then calls each public kernel function with small CPU tensors,
once per compiled variant (flags, dtypes, tile choices). Run by tests/test_compile_for_hopper.py in a process
of its own, without TRITON_INTERPRET.
"""

from __future__ import annotations

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import jit
from triton.runtime.driver import driver


class CompileOnlyDriver(CudaDriver):
    """The CUDA driver's answers to the compiler, for an H100, with no GPU behind them."""

    def __init__(self):  # the real one loads libcuda
        pass

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def compile_only(run):
    def wrapper(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)
    return wrapper


def main() -> None:
    driver.set_active(CompileOnlyDriver())
    jit.JITFunction.run = compile_only(jit.JITFunction.run)
    from flashpage.kernels import pdl, topk
    pdl.enabled = lambda device: True  # as on a Hopper GPU: the kernels that can launch early do
    from flashpage.kernels import batch_invariant as inv
    from flashpage.kernels import hopper_prefill
    from flashpage.kernels import triton_ops as tri
    from flashpage.kernels.block_sparse import BlockChoice
    from flashpage.kv import KVCache

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape).to(dtype)

    for dtype in (torch.bfloat16, torch.float16):
        # attention: varlen prefill (plain and windowed), paged decode with and without splits, paged prefill
        q, k, v = rand(40, 8, 128, dtype=dtype), rand(40, 2, 128, dtype=dtype), rand(40, 2, 128, dtype=dtype)
        cu = torch.tensor([0, 17, 40], dtype=torch.int32)
        tri.flash_attn_varlen(q, k, v, cu, cu, 23, 23)
        tri.flash_attn_varlen(q, k, v, cu, cu, 23, 23, window_size=(7, 0))
        cache = rand(8, 16, 2, 128, dtype=dtype)
        table = torch.arange(8, dtype=torch.int32).view(2, 4)
        lens = torch.tensor([50, 33], dtype=torch.int32)
        decode = (rand(2, 8, 128, dtype=dtype), torch.tensor([0, 1, 2], dtype=torch.int32))
        for splits in (1, 4):  # split-KV decode reads through the copy engine (TMA), also with a window
            tri.paged_attention(decode[0], KVCache(cache, cache), table, decode[1], lens, 1, num_splits=splits)
        tri.paged_attention(decode[0], KVCache(cache, cache), table, decode[1], lens, 1, num_splits=4, window_size=(20, 0))
        small_pages = rand(16, 8, 2, 128, dtype=dtype)  # pages of 8 keys: too small for a TMA tile
        tri.paged_attention(decode[0], KVCache(small_pages, small_pages), table, decode[1], lens, 1, num_splits=4)
        tri.paged_attention(rand(9, 8, 128, dtype=dtype), KVCache(cache, cache), table, torch.tensor([0, 4, 9], dtype=torch.int32),
                            lens, 5)
        tri.reshape_and_cache(k[:3], v[:3], KVCache(cache, cache), torch.tensor([5, -1, 70]))
        ones = torch.ones(2)  # quantized caches: FP8 (per-head scales), INT8 (per-token scales); reads and writes
        fp8 = KVCache(cache.to(torch.float8_e4m3fn), cache.to(torch.float8_e4m3fn), ones, ones)
        int8 = KVCache(cache.to(torch.int8), cache.to(torch.int8), torch.ones(8, 2, 16), torch.ones(8, 2, 16))
        for quantized in (fp8, int8):
            for splits in (1, 4):
                tri.paged_attention(decode[0], quantized, table, decode[1], lens, 1, num_splits=splits)
            tri.paged_attention(rand(9, 8, 128, dtype=dtype), quantized, table,
                                torch.tensor([0, 4, 9], dtype=torch.int32), lens, 5)
            tri.reshape_and_cache(k[:3], v[:3], quantized, torch.tensor([5, -1, 70]))
            tri.rope_and_cache(q, k, rand(40, 128, dtype=dtype), rand(40, 128, dtype=dtype), v, quantized,
                               torch.arange(40))
        rotated = KVCache(fp8.k, fp8.v, ones, ones, keys_rotated=True)  # FP8 keys stored rotated (and the queries)
        tri.rope_and_cache(q, k, rand(40, 128, dtype=dtype), rand(40, 128, dtype=dtype), v, rotated, torch.arange(40))
        tree = torch.tensor([1, 3, 5, 11, 7, 1, 3, 5, 9], dtype=torch.int64)  # token trees: prefill and decode tiles
        tri.paged_attention(rand(9, 8, 128, dtype=dtype), KVCache(cache, cache), table,
                            torch.tensor([0, 4, 9], dtype=torch.int32), lens, 5, query_mask=tree)
        tri.paged_attention(rand(4, 8, 128, dtype=dtype), KVCache(cache, cache), table,
                            torch.tensor([0, 2, 4], dtype=torch.int32), lens, 2, query_mask=tree[:4])
        tri.paged_attention(decode[0], KVCache(small_pages.to(torch.int8), small_pages.to(torch.int8),
                                               torch.ones(16, 2, 8), torch.ones(16, 2, 8)), table, decode[1], lens, 1)
        # key blocks chosen per KV head: a block table per head (prefill, and one-query blocks through the decode
        # tiles), and the estimate that chooses them (head dims 64 and 128, groups of 4 and 3)
        per_head = (torch.arange(18, dtype=torch.int32) % 8).view(2, 9)[:, None, :4].expand(2, 2, 4)
        tri.paged_attention(rand(9, 8, 128, dtype=dtype), KVCache(cache, cache), per_head,
                            torch.tensor([0, 4, 9], dtype=torch.int32), lens, 5)
        tri.paged_attention(decode[0], KVCache(cache, cache), per_head, decode[1], lens, 1)
        for one_head in (False, True):  # (each sampled query in all its group's heads, or in one)
            choice = BlockChoice(torch.tensor([[0, 0, 0, 9, 40, 1, 1, 1]], dtype=torch.int32),
                                 torch.tensor([[0, 1]], dtype=torch.int32), 2, 1, 64, 8, one_head)
            for dim in (64, 128):
                pages = rand(8, 16, 2, dim, dtype=dtype)
                for heads in (8, 6, 16, 2):  # groups of 4, 3, 8 and 1: each count of query blocks per program
                    tri.block_mass(rand(9, heads, dim, dtype=dtype), KVCache(pages, pages), table, choice)
        for values in (rand(3, 50, dtype=torch.float16), rand(3, 50)):  # the top-k: 16- and 32-bit, k per row
            tri.top_k_positions(values, 5)
            tri.top_k_positions(values, torch.full((3,), 4), 6, 50, torch.int64)
            tri.top_k_positions(values.repeat(1, 100), 300)  # (rows past MAX_ROW: the chunked select)
            tri.top_k_positions(values.repeat(1, 100), 300, drop_bits=10)  # (one digit: SparQ's fp16 sums)
            tri.top_k_positions(values, 5, drop_bits=10)
            chunk, topk.CHUNK = topk.CHUNK, topk.SHORT_CHUNK  # (its chunks where rows are few on a GPU)
            tri.top_k_positions(values.repeat(1, 100), 300)
            topk.CHUNK = chunk
        # SparQ decode (4 and 3 query heads per KV head; r under 16 and over; the paper's basis and another; 4 value
        # axes; the key copy in e4m3 and in 4 bits) and its cache extras
        k_t = cache.permute(0, 2, 3, 1).contiguous().to(torch.float8_e4m3fn)
        copy4 = dict(k_t=torch.zeros(2, 2, 128, 32, dtype=torch.uint8), k_t_scale=rand(2, 2, 64).to(k_t.dtype))
        for basis, axes, bits in ((None, 0, 8), (rand(2, 128, 128, dtype=dtype), 0, 8), (None, 4, 8),
                                  (rand(2, 128, 128, dtype=dtype), 4, 4)):
            with_axes = dict(v_t=k_t[:, :, :16, :axes].contiguous(), sparq_value_rms=torch.ones(2, axes),
                             sparq_value_axes=rand(2, 128, axes, dtype=torch.float32)) if axes else {}
            pages = cache.view(2, 64, 2, 128) if bits == 4 else cache  # (the 4-bit copy: blocks of 64 only)
            copy = copy4 if bits == 4 else dict(k_t=k_t)
            with_axes = dict(with_axes, v_t=with_axes["v_t"].view(2, 2, 64, axes)) if bits == 4 else with_axes
            sparq_cache = KVCache(pages, pages, v_cumsum=torch.zeros(len(pages), 2, 128), sparq_basis=basis, **copy,
                                  **with_axes)
            for heads, r in ((8, 32), (6, 8)):
                tri.sparq_attention(rand(2, heads, 128, dtype=dtype), sparq_cache, table, decode[1], lens, 1, r=r,
                                    k=24)
            max_row, topk.MAX_ROW = topk.MAX_ROW, 0  # (rows the chunked select takes: the aggregation counts digits)
            tri.sparq_attention(rand(2, 8, 128, dtype=dtype), sparq_cache, table, decode[1], lens, 1, r=32, k=24)
            topk.MAX_ROW = max_row
            tri.write_sparq_copies(rand(40, 2, 128, dtype=dtype), sparq_cache, torch.arange(40), table,
                                   torch.tensor([0, 17, 40], dtype=torch.int32), lens)
        # norm, activation, rotary (alone and with the cache write), the decode linear in each of its forms
        x, w = rand(3, 256, dtype=dtype), rand(256, dtype=dtype)
        tri.rms_norm(x, w, 1e-5)
        tri.silu_and_mul(rand(3, 512, dtype=dtype))
        cos_sin = rand(40, 128, dtype=dtype)
        tri.rope_and_cache(q, k, cos_sin, cos_sin)
        tri.rope_and_cache(q, k, cos_sin, cos_sin, v, KVCache(cache, cache), torch.arange(40))
        weight = rand(64, 256, dtype=dtype)
        tri.linear(x, weight)
        tri.linear(x, weight, rand(64, dtype=dtype), residual=rand(3, 64, dtype=dtype))
        tri.linear(x, weight, norm_weight=w, eps=1e-5, silu_mul=True)
        tri.linear(x, weight, norm_weight=w, eps=1e-5, out_dtype=torch.float32)
        fp8, scale = weight.to(torch.float8_e4m3fn), rand(64, dtype=torch.float32)  # FP8 weights
        tri.linear(x, fp8, rand(64, dtype=dtype), residual=rand(3, 64, dtype=dtype), weight_scale=scale)
        tri.linear(x, fp8, norm_weight=w, eps=1e-5, silu_mul=True, weight_scale=scale)
        for rows in (20, 100, 150, 240):  # over the decode rows: the FP8 x FP8 kernel's tile classes (bf16), and
            # beyond them the quantizer alone (cuBLAS multiplies), SiLU-and-mul's in it too
            xr = rand(rows, 256, dtype=dtype)
            tri.linear(xr, fp8, rand(64, dtype=dtype), residual=rand(rows, 64, dtype=dtype), weight_scale=scale)
            tri.linear(xr, fp8, norm_weight=w, eps=1e-5, silu_mul=True, weight_scale=scale)
            tri.linear(xr, fp8, norm_weight=w, eps=1e-5, silu_mul=True, weight_scale=scale, quantized_output=True)
        # the batch-invariant set (deterministic mode): its linear, its attention tiles without the copy engine
        for ops_x in (x, rand(70, 256, dtype=dtype), rand(200, 256, dtype=dtype)):  # each tile class
            inv.linear(ops_x, weight, residual=rand(ops_x.shape[0], 64, dtype=dtype))
            inv.linear(ops_x, weight, norm_weight=w, eps=1e-5, silu_mul=True)
            inv.linear(ops_x, weight, norm_weight=w, eps=1e-5, out_dtype=torch.float32)
        inv.paged_attention(decode[0], KVCache(cache, cache), table, decode[1], lens, 1)
        inv.flash_attn_varlen(q, k, v, cu, cu, 23, 23)
        # the Hopper prefill (Gluon; the GPU dispatch picks it, CPU tensors never do): contiguous and paged K/V
        # (pages of 16 and of 64 keys), causal or not, with a window or not, FP8, head dims 64 and 128, the short
        # items' tiles in persistent programs (2 for 4 work items: Q double-buffered) and the others one per item;
        # Q copied as a box (a group of 4) or gathered (3)
        for dim in (64, 128):
            q, k = rand(40, 8, dim, dtype=dtype), rand(40, 2, dim, dtype=dtype)
            for short, programs in ((True, 2), (False, 10**9)):
                tiles = hopper_prefill.short_item_tiles(dim) if short else hopper_prefill.default_tiles(dim)
                for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (7, 0))):
                    hopper_prefill.prefill(q, k, k, torch.empty_like(q), cu, cu, None, None, 23, 23, causal=causal,
                                           sm_scale_log2=0.1, window_size=window, tiles=tiles, programs=programs)
                # a group that does not divide a consumer's rows (SmolLM2's 3): Q gathered, not copied as a box
                q3 = rand(40, 6, dim, dtype=dtype)
                hopper_prefill.prefill(q3, k, k, torch.empty_like(q3), cu, cu, None, None, 23, 23, causal=True,
                                       sm_scale_log2=0.1, window_size=(-1, -1), tiles=tiles, programs=programs)
                hopper_prefill.prefill_fp8(hopper_prefill.quantize_inputs(q, k, k, cu), torch.empty_like(q), cu, 23,
                                           23, causal=True, sm_scale_log2=0.1, window_size=(-1, -1), tiles=tiles,
                                           programs=programs)
                for page in (16, 64):
                    pages = rand(8, page, 2, dim, dtype=dtype)
                    for pages_of in (table, per_head):  # (one table, or a table per KV head)
                        hopper_prefill.prefill(q, pages, pages, torch.empty_like(q), cu, None, lens, pages_of, 23,
                                               None, causal=True, sm_scale_log2=0.1, window_size=(-1, -1),
                                               tiles=tiles, programs=programs)
                # an FP8 cache (a scale per KV head), with its own tiles
                pages, ones = rand(8, 16, 2, dim).to(torch.float8_e4m3fn), torch.ones(2)
                hopper_prefill.prefill(q, pages, pages, torch.empty_like(q), cu, None, lens, table, 23, None,
                                       causal=True, sm_scale_log2=0.1, window_size=(-1, -1),
                                       tiles=hopper_prefill.fp8_cache_tiles(dim, short), programs=programs,
                                       cache_scales=(ones, ones))
    # float32 attention (tests' tiny models): float32 products, not TF32
    q, k = rand(40, 8, 64, dtype=torch.float32), rand(40, 2, 64, dtype=torch.float32)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    tri.flash_attn_varlen(q, k, k, cu, cu, 23, 23)
    cache = rand(8, 16, 2, 64, dtype=torch.float32)
    for splits in (1, 4):
        tri.paged_attention(q[:2], KVCache(cache, cache), torch.arange(8, dtype=torch.int32).view(2, 4),
                            torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([50, 33], dtype=torch.int32), 1,
                            num_splits=splits)
    # sampling (float32 logits), with and without the top-k / top-p search and draft tokens to verify, the
    # penalties and a grammar's token mask
    logits = torch.randn(3, 1000)
    full = lambda v, dt: torch.full((3,), v, dtype=dt)  # noqa: E731
    args = (full(0.8, torch.float32), full(50, torch.int32), full(0.9, torch.float32), full(0.05, torch.float32),
            full(7, torch.int64))
    for filtered in (True, False):
        tri.sample(logits, *args, filtered=filtered)
        tri.sample(logits, *args, filtered=filtered, draft_tokens=torch.tensor([3, -1, 8]),
                   draft_probs=torch.rand(3, 1000))
    tri.apply_penalties(logits, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([5, 9]),
                        torch.tensor([1, 0], dtype=torch.int32), *(full(1.1, torch.float32) for _ in range(3)))
    tri.apply_token_bitmask(logits, torch.full((3, 32), -1, dtype=torch.int32))
    tri.greedy(logits)
    inv.greedy(logits)
    inv.sample(logits, *args)
    print("all kernels compiled for sm_90")


if __name__ == "__main__":
    main()
