"""`flashpage bench kernels --sparse`: SparQ decode against the dense paged decode, and block-sparse prefill
against the dense paged prefill, same caches, same run.

Block-sparse: one sequence's prompt of 16k/32k/64k tokens prefilled through the paged path (bf16, 32/8 heads,
head dim 128, block size 16, shuffled), dense and under patterns of blocks of 64 with one sink block, a vertical
line every 64 blocks and the window that brings the share of causal keys seen nearest 25% and 10%; and with key
blocks chosen per KV head at densities 25% and 10% (one sink block, a window of two), each sampled query in all its
group's heads ("chosen") or in one ("chosen1", `"sample_heads": "one"`), timed whole: the estimate (`block_mass`),
the choice (the top-k and the tables' fill) and the attention.

bf16, 32 query / 8 KV heads, head dim 128, shuffled blocks, batch 1/8/64 x context 8k/32k/128k (the largest left
out where the cache would not fit). SparQ at two budgets of the dense decode's bytes (K and V): 1/8 (r = 32
components of one byte in the e4m3 copy: 1/16, k = context / 16 keys and values: 1/16) and 1/4 (r = 64, k = context
/ 8); at block size 16 and 64 (SparQ's default: a component's keys of one block are then 64 contiguous bytes
instead of 16; there also "1/8 v": r = 24 with the values' coordinates along 8 axes, `"value_axes": 8`, and "1/8
v2": r = 28 with 4 axes, the splits of 1/8 that kept most of SmolLM2's quality, as `bench quality --sparse` names
them; "1/8 v2 r8": that with the last 8 keys always chosen; "1/8 v2 r8 4-bit": that with the key copy in 4 bits,
r = 52, `"key_bits": 4`), and at 1/8 reading the components from K itself instead of the component-major copy
("strided", "K" in the table: twice the copy's bytes). The
copy is in an orthonormal basis per KV head, as the engine's default (`"basis": "pca"`), so the queries' turn into
it is in the time; at 1/8 also without one (the paper's basis, "I" in the table; "strided" reads K as it is, so
in the paper's basis too). Each is timed as a CUDA
graph (as the engine runs decode), after warm-up, median of many replays, against the dense decode over the same
cache; the table also gives the time of SparQ's phases (approximate scores, aggregation, the keys' top-k, exact
attention, combine, the queries' turn into the basis; "torch": whatever else runs) from eager runs under the
profiler.
"""

from __future__ import annotations

import dataclasses

import torch

from flashpage.bench.common import median_ms
from flashpage.bench.quality import SPARQ_BUDGETS
from flashpage.engine.inputs import block_sparse_view
from flashpage.kernels import reference, sparq, triton_ops
from flashpage.kernels.attention import choose_num_splits
from flashpage.kernels.block_sparse import BlockSparsePattern, choose_blocks
from flashpage.kernels.triton_ops import paged_attention
from flashpage.kv import KVCache
from flashpage.kv.cache import SPARQ_COPY_DTYPE

HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (8, 131072), (64, 8192), (64, 32768)]
# name: (r, context / k, value axes, recent keys, bits of the key copy) at head dim D: the quality bench's budgets
# (set per 64 of the head dimension, where "1/8 v" and "1/8 v2" spend a quarter and an eighth of the r components'
# bytes on the values' coordinates)
BUDGETS = {name: (r * D // 64, per_k, axes * D // 64, recent, key_bits)
           for name, (r, axes, per_k, recent, key_bits) in SPARQ_BUDGETS.items()}


def graph_ms(fn) -> float:
    """Median ms of `fn` replayed as a CUDA graph (captured after a warm-up run)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def sparq_cache(batch: int, context: int, block: int = 16, axes: int = 0) -> tuple[KVCache, torch.Tensor]:
    """A random bf16 cache with its SparQ extras (`axes`: its values' coordinates along so many axes), each
    sequence's blocks shuffled."""
    blocks = batch * context // block
    k = torch.randn(blocks, block, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, context // block)
    k_t = k.permute(0, 2, 3, 1).contiguous().to(SPARQ_COPY_DTYPE)
    v_cumsum = torch.empty(blocks, HKV, D, device="cuda", dtype=torch.float32)
    for i in range(batch):  # each block: the sequence's values summed up to its end
        rows = table[i].long()
        v_cumsum[rows] = v[rows].float().sum(1).cumsum(0)
    # contiguous, as the engine stores its bases: QR's Q is column-major, and the kernels would copy it every step
    basis = torch.linalg.qr(torch.randn(HKV, D, D, device="cuda")).Q.contiguous().to(torch.bfloat16)
    with_axes = {}
    if axes:
        value_axes = torch.linalg.qr(torch.randn(HKV, D, D, device="cuda")).Q[..., :axes].contiguous()
        v_t = torch.empty(blocks, HKV, block, axes, device="cuda", dtype=SPARQ_COPY_DTYPE)
        for i in range(0, blocks, 4096):  # (in pieces: a float32 copy of a large cache's values would not fit)
            v_t[i:i + 4096] = torch.einsum("btkd,kdm->bktm", v[i:i + 4096].float(), value_axes).to(v_t.dtype)
        with_axes = dict(v_t=v_t, sparq_value_axes=value_axes, sparq_value_rms=torch.ones(HKV, axes, device="cuda"))
    return KVCache(k, v, k_t=k_t, v_cumsum=v_cumsum, sparq_basis=basis, **with_axes), table


def bench_sparq(batch: int, context: int, block: int) -> list[dict]:
    variants = [("1/8", False, True), ("1/8 v", False, True), ("1/8 v2", False, True), ("1/8 v2 r8", False, True),
                ("1/8 v2 r8 4-bit", False, True)] if block == 64 else \
        [("1/8", False, True), ("1/4", False, True), ("1/8", False, False), ("1/8", True, False)]
    cache, table = sparq_cache(batch, context, block, axes=max(BUDGETS[name][2] for name, _, _ in variants))
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    splits = choose_num_splits(batch, HKV, 1, context, q.device)
    dense_ms = graph_ms(lambda: paged_attention(q, cache, table, cu, lens, 1, num_splits=splits, out=out))
    dense_bytes = 2 * batch * context * HKV * D * 2
    rows = []
    copy4 = None  # (the key copy in 4 bits, made once the first variant asks for it)
    for name, strided, turned in variants:  # (budget, strided, in a basis)
        r, per_k, axes, recent, key_bits = BUDGETS[name]
        k = context // per_k
        read = with_axes(cache if turned else dataclasses.replace(cache, sparq_basis=None), axes)
        if key_bits == 4:
            copy4 = copy4 or in_4_bits(cache)
            read = dataclasses.replace(read, **copy4)
        ms = graph_ms(lambda: sparq.sparq_attention(q, read, table, cu, lens, 1, r=r, k=k, recent=recent, out=out,
                                                    strided=strided))
        rows.append({"kind": "sparq decode", "shape": f"{batch}x{context}", "block_size": block, "budget": name,
                     "r": r, "k": k, "value_axes": axes, "recent": recent, "key_bits": key_bits, "strided": strided,
                     "basis": turned,
                     "ms": ms, "dense_ms": dense_ms,
                     "speedup_vs_dense": dense_ms / ms, "dense_rate_tbs": dense_bytes / dense_ms / 1e9,
                     "phases_ms": sparq_phases(q, read, table, lens, r, k, strided)})
    return rows


def in_4_bits(cache: KVCache) -> dict[str, torch.Tensor]:
    """The cache's keys as a 4-bit key copy holds them (`reference.int4_keys`): {"k_t": two keys a byte,
    "k_t_scale": each key's scale} (the copy's keys as `sparq_cache` makes its e4m3 one: K as it is)."""
    blocks, page = cache.k.shape[:2]
    k_t = torch.empty(blocks, HKV, D, page // 2, device="cuda", dtype=torch.uint8)
    scale = torch.empty(blocks, HKV, page, device="cuda", dtype=SPARQ_COPY_DTYPE)
    for i in range(0, blocks, 256):  # (in pieces: the float64 codes of a large cache would not fit)
        keys = cache.k[i:i + 256]
        codes, s = reference.int4_keys(keys.flatten(0, 1))
        codes = codes.view(keys.shape).permute(0, 2, 3, 1)  # [blocks, Hkv, D, page]
        k_t[i:i + 256] = codes[..., :page // 2] | (codes[..., page // 2:] << 4)
        scale[i:i + 256] = s.view(keys.shape[:3]).transpose(1, 2)
    return {"k_t": k_t, "k_t_scale": scale}


def with_axes(cache: KVCache, axes: int) -> KVCache:
    """The cache with its values' coordinates along its first `axes` axes only (none for 0), stored as a cache
    built with that many would store them."""
    if not axes:
        return dataclasses.replace(cache, v_t=None, sparq_value_axes=None, sparq_value_rms=None)
    return dataclasses.replace(cache, v_t=cache.v_t[..., :axes].contiguous(),
                               sparq_value_axes=cache.sparq_value_axes[..., :axes].contiguous(),
                               sparq_value_rms=cache.sparq_value_rms[..., :axes].contiguous())


PHASES = {"_approximate_scores": "scores", "_aggregate": "aggregate", "_histogram_kernel": "top-k",
          "_count_kernel": "top-k", "_write_kernel": "top-k", "_attend_chosen": "attend", "_combine": "combine",
          "_turn_queries": "turn"}


def sparq_phases(q, cache, table, lens, r, k, strided=False) -> dict[str, float]:
    """GPU time per phase of one eager SparQ step (median of 5, by the profiler's kernel names): its own kernels,
    and any other (torch's own) as "torch"."""
    cu = torch.arange(q.shape[0] + 1, device="cuda", dtype=torch.int32)
    runs = []
    for _ in range(5):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            sparq.sparq_attention(q, cache, table, cu, lens, 1, r=r, k=k, strided=strided)
            torch.cuda.synchronize()
        times: dict[str, float] = {}
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            name = next((v for key, v in PHASES.items() if key in e.key), "torch")
            times[name] = times.get(name, 0.0) + us / 1e3
        runs.append(times)
    return {n: sorted(t.get(n, 0.0) for t in runs)[2] for n in [*dict.fromkeys(PHASES.values()), "torch"]}


def pattern_for(context: int, density: float) -> BlockSparsePattern:
    """Blocks of 64, one sink block, a vertical line every 64 blocks, and the window that brings the share of the
    causal keys seen closest to `density`."""
    pos = torch.arange(context)
    causal = float((pos + 1).sum())
    return min((BlockSparsePattern(64, 1, local, 64) for local in range(1, context // 64 + 1)),
               key=lambda p: abs(float(p.keys_seen(pos).sum()) / causal - density))


def bench_block_sparse(context: int, matmul_tflops: float) -> list[dict]:
    """One sequence's prompt of `context` tokens prefilled through the paged path (block size 16, shuffled), dense
    and under patterns of about 25% and 10% density."""
    blocks = context // 16
    k = torch.randn(blocks, 16, HKV, D, device="cuda", dtype=torch.bfloat16)
    cache = KVCache(k, torch.randn_like(k))
    table = torch.randperm(blocks, device="cuda").to(torch.int32).view(1, blocks)
    q = torch.randn(context, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, context], device="cuda", dtype=torch.int32)
    lens = torch.tensor([context], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    dense_ms = median_ms(lambda: paged_attention(q, cache, table, cu, lens, context, out=out))
    flops = 4 * HQ * context * context * D / 2

    def row(pattern, kept, ms, attend_ms):  # (attend_ms: the attention alone, whose kept tiles' rate is given)
        return {"kind": "block-sparse prefill", "shape": f"1x{context}", "pattern": pattern.__dict__, "density": kept,
                "ms": ms, "dense_ms": dense_ms, "speedup_vs_dense": dense_ms / ms, "dense_tflops": flops / dense_ms /
                1e9, "dense_fraction_of_matmul": flops / dense_ms / 1e9 / matmul_tflops,
                "sparse_tflops_on_kept": flops * kept / attend_ms / 1e9}

    rows = []
    for density in (0.25, 0.10):
        pattern = pattern_for(context, density)
        pos = torch.arange(context)
        kept = float(pattern.keys_seen(pos).sum()) / float((pos + 1).sum())
        view = block_sparse_view(pattern, pattern.split([context], [context], table.tolist(), 16), q.device)
        ms = median_ms(lambda: paged_attention(q, cache, view.block_table, view.cu_seqlens_q, view.seq_lens_k,
                                               view.max_seqlen_q, out=out))
        rows.append(row(pattern, kept, ms, ms))
    for density, one_head in ((0.25, False), (0.10, False), (0.25, True), (0.10, True)):
        # blocks chosen per KV head: the estimate, the choice and the attention, timed
        pattern = BlockSparsePattern(64, 1, 2, 0, density, one_head=one_head)
        pos = torch.arange(context)
        kept = float(pattern.keys_seen(pos).sum()) / float((pos + 1).sum())
        view = block_sparse_view(pattern, pattern.split([context], [context], table.tolist(), 16), q.device)
        choice = view.block_choice
        mass_ms = median_ms(lambda: triton_ops.block_mass(q, cache, table, choice))
        chosen = choose_blocks(triton_ops, q, cache, table, view.block_table, choice, None)
        choose_ms = median_ms(lambda: choose_blocks(triton_ops, q, cache, table, view.block_table, choice, None))
        attend_ms = median_ms(lambda: paged_attention(q, cache, chosen, view.cu_seqlens_q, view.seq_lens_k,
                                                      view.max_seqlen_q, out=out))

        def whole():
            paged_attention(q, cache, choose_blocks(triton_ops, q, cache, table, view.block_table, choice, None),
                            view.cu_seqlens_q, view.seq_lens_k, view.max_seqlen_q, out=out)
        ms = median_ms(whole)
        rows.append({**row(pattern, kept, ms, attend_ms), "estimate_ms": mass_ms, "estimate_and_choice_ms": choose_ms,
                     "attention_ms": attend_ms})
    return rows


def run(copy_tbs: float, matmul_tflops: float, sparq_decode: bool = True) -> list[dict]:
    rows = []
    for context in (16384, 32768, 65536):
        rows += bench_block_sparse(context, matmul_tflops)
    print(f"\n{'block-sparse prefill':22s} {'blocks':>6s} {'density':>7s} {'window':>6s} {'dense ms':>9s} "
          f"{'TFLOP/s':>8s} {'sparse ms':>9s} {'speedup':>8s} {'TFLOP/s on kept':>15s}  estimate + choice ms")
    for r in rows:
        how = ("chosen1" if r["pattern"]["one_head"] else "chosen") if r["pattern"]["density"] else "fixed"
        extra = f"  {r['estimate_ms']:.3f} + {r['estimate_and_choice_ms'] - r['estimate_ms']:.3f}" if \
            r["pattern"]["density"] else ""
        print(f"{r['shape']:22s} {how:>6s} {r['density']:7.1%} {r['pattern']['local']:6d} {r['dense_ms']:9.3f} "
              f"{r['dense_tflops']:8.0f} {r['ms']:9.3f} {r['speedup_vs_dense']:7.2f}x "
              f"{r['sparse_tflops_on_kept']:15.0f}{extra}")
    free = torch.cuda.mem_get_info()[0]
    for batch, context in SHAPES if sparq_decode else []:
        need = 5.5 * batch * context * HKV * D * 1.6  # K, V (2 bytes), their copies (1, 0.5), the step's buffers
        if need > free:
            print(f"sparq decode {batch}x{context}: left out (needs about {need / 2**30:.0f} GiB)", flush=True)
            continue
        for block in (16, 64):
            rows += bench_sparq(batch, context, block)
            torch.cuda.empty_cache()
    print(f"\n{'SparQ decode':14s} {'block':>5s} {'budget':>15s} {'r':>4s} {'k':>6s} {'dense ms':>9s} "
          f"{'dense TB/s':>10s} {'of copy':>7s} {'SparQ ms':>9s} {'speedup':>8s}  phases (ms)")
    for r in (r for r in rows if r["kind"] == "sparq decode"):
        phases = " ".join(f"{n} {t:.3f}" for n, t in r["phases_ms"].items())
        budget = r["budget"] + (" K" if r["strided"] else "" if r["basis"] else " I")
        print(f"{r['shape']:14s} {r['block_size']:5d} {budget:>15s} {r['r']:4d} {r['k']:6d} {r['dense_ms']:9.4f} "
              f"{r['dense_rate_tbs']:10.2f} {r['dense_rate_tbs'] / copy_tbs:7.0%} {r['ms']:9.4f} "
              f"{r['speedup_vs_dense']:7.2f}x  {phases}")
    return rows
