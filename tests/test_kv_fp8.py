"""An FP8 (e4m3) KV cache (kv_cache_dtype="fp8"): the writes, the attention kernels reading it, and the engine
over it with its quality cost on the default model."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, engine_from, rel_err
from flashpage import LLM, SamplingParams
from flashpage.kernels import reference as ref
from flashpage.kernels import triton_ops as tri
from flashpage.kernels.fp8 import FP8
from flashpage.kv import KVCache
from test_engine import run
from test_fp8 import interpreter_e4m3_agrees, perplexity
from test_kernels import PAGED_CASES, TOL, nan_like, paged_case, rand


@pytest.mark.parametrize("lens_k,lens_q,page,hq,hkv,dim,window,splits", PAGED_CASES)
def test_paged_attention_reads_an_fp8_cache(lens_k, lens_q, page, hq, hkv, dim, window, splits):
    """bf16 queries over an e4m3 cache, against float64 attention over the cache's values; the slots past each
    sequence's end hold NaN bytes (read as 480 by the interpreter, which knows no e4m3 NaN: masked either way)."""
    k_cache, v_cache, table, seq_lens, cu_q = paged_case(lens_k, lens_q, page, hkv, dim, torch.float32,
                                                         shared_prefix_blocks=1 if len(lens_k) > 1 else 0)
    k_cache, v_cache = (c.mul(4).to(FP8) for c in (k_cache, v_cache))
    for i, n in enumerate(lens_k):
        last = int(table[i, (n - 1) // page])
        if n % page and int((table == last).sum()) == 1:  # (not a block another sequence reads whole)
            for c in (k_cache, v_cache):
                c.view(torch.uint8)[last, n % page:] = 0x7F  # e4m3's NaN
    q = rand(sum(lens_q), hq, dim, dtype=torch.bfloat16)
    out = tri.paged_attention(q, KVCache(k_cache, v_cache), table, cu_q, seq_lens, max(lens_q), window_size=window,
                              num_splits=splits, out=nan_like(q))
    expected = ref.paged_attention(q.double(), KVCache(k_cache.double(), v_cache.double()), table, cu_q, seq_lens,
                                   max(lens_q), window_size=window)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < TOL[torch.bfloat16]


def test_cache_writes_saturate_into_fp8():
    """reshape_and_cache and the fused rotary + cache write store e4m3 values, saturating at 448, as the reference
    does; the interpreter converts to e4m3 within one step of the GPU's rounding (tests/test_fp8.py)."""
    page, hkv, dim, t = 16, 3, 64, 6
    slots = torch.tensor([0, 17, -1, 95, 40, 41], device=DEVICE)
    k, v = rand(t, hkv, dim, dtype=torch.bfloat16) * 300, rand(t, hkv, dim, dtype=torch.bfloat16) * 300
    caches = [KVCache(torch.zeros(6, page, hkv, dim, dtype=FP8), torch.zeros(6, page, hkv, dim, dtype=FP8))
              for _ in range(3)]
    ref.reshape_and_cache(k, v, caches[0], slots)
    tri.reshape_and_cache(k, v, caches[1], slots)
    ones = torch.ones(t, dim, dtype=torch.bfloat16)  # rotation by angle 0: the cache gets k itself
    tri.rope_and_cache(rand(t, 8, dim, dtype=torch.bfloat16), k.clone(), ones, torch.zeros_like(ones), v, caches[2],
                       slots)
    want = caches[0]
    assert want.k.float().abs().max() == 448 and torch.isfinite(want.k.float()).all()
    for got in caches[1:]:
        for a, b in ((got.k.float(), want.k.float()), (got.v.float(), want.v.float())):
            assert interpreter_e4m3_agrees(a, b).all()


def test_fp8_cache_holds_more_tokens_and_serves_every_feature(smollm_llm):
    """Four times the blocks of a float32 cache in the same memory; batched with prefix sharing, n > 1, chunked
    prefill and preemption, requests start as they do alone over the same FP8 cache. Not token for token to the
    end, as with a 16/32-bit cache: a preempted sequence's K/V are recomputed by a prefill, whose float32 values
    differ from the decode's in the last bits, and rounding to e4m3 turns some of those into a step of 6%."""
    dense = engine_from(smollm_llm, cpu_kv_cache_gb=0.05)
    fp8 = engine_from(smollm_llm, cpu_kv_cache_gb=0.05, kv_cache_dtype="fp8")
    blocks, dense_blocks = fp8.stats()["kv_blocks_total"], dense.stats()["kv_blocks_total"]
    assert 4 * dense_blocks <= blocks < 4 * (dense_blocks + 1)  # (each rounded down to whole blocks)
    shared = list(range(200, 248))
    prompts = [shared + [i, i + 1] for i in range(4)] + [[5] * 3]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4 + [SamplingParams(n=2, temperature=0.8, seed=3,
                                                                                  max_tokens=12)]

    def tokens(engine, prompts, params):
        return [[s.token_ids for s in o.outputs] for o in run(engine, prompts, params)]

    batched = engine_from(smollm_llm, kv_cache_dtype="fp8", num_gpu_blocks=8, max_num_batched_tokens=32)
    together = tokens(batched, prompts, params)
    assert batched.stats()["num_preemptions"] > 0 and batched.stats()["prefix_cache_hits"] > 0
    alone = [tokens(engine_from(smollm_llm, kv_cache_dtype="fp8"), [p], [sp])[0] for p, sp in zip(prompts, params)]
    pairs = [(a, b) for t, u in zip(together, alone) for a, b in zip(t, u, strict=True)]
    assert all(a[:12] == b[:12] for a, b in pairs)
    same = sum(x == y for a, b in pairs for x, y in zip(a, b)) / sum(len(b) for _, b in pairs)
    print(f"FP8 cache, batched and preempted against alone: {same:.0%} of the tokens equal")
    assert same > 0.75


def test_fp8_cache_quality_on_real_text(smollm_llm, smollm_gguf):
    """SmolLM2 on CPython's documentation: perplexity over 2,048 tokens, float32 cache against FP8 (prompt tokens
    attend to the cache's values, as decode does)."""
    from pydoc_data.topics import topics

    ids = smollm_llm.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics))[:30000])[:2048]
    fp8 = LLM(str(smollm_gguf), dtype="float32", device="cpu", kv_cache_dtype="fp8")
    dense_ppl, fp8_ppl = perplexity(smollm_llm, ids, 1024), perplexity(fp8, ids, 1024)
    print(f"perplexity float32 cache {dense_ppl:.3f}, fp8 cache {fp8_ppl:.3f} ({fp8_ppl / dense_ppl - 1:+.2%})")
    assert fp8_ppl / dense_ppl < 1.02
