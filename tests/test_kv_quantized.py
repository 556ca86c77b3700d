"""Quantized KV caches (kv_cache_dtype="fp8" / "int8", `flashpage.kv.cache`): the writes and their scales, the
attention kernels reading them, the engine over them, checkpoint scales, and the quality cost on the default
model."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import DEVICE, engine_from, rel_err
from flashpage import LLM, SamplingParams
from flashpage.bench.quality import perplexity
from flashpage.kernels import reference as ref
from flashpage.kernels import triton_ops as tri
from flashpage.kernels.fp8 import FP8
from flashpage.kv import KVCache
from test_engine import run
from test_fp8 import interpreter_e4m3_agrees
from test_kernels import PAGED_CASES, TOL, nan_like, paged_case, plant_jumps, rand

DTYPES = {"fp8": FP8, "int8": torch.int8}


def quantized_case(kind, lens_k, lens_q, page, hkv, dim):
    """A paged case whose cache is quantized by the reference writer (FP8 with random per-head scales), the slots
    past each sequence's end poisoned: NaN bytes (FP8; read as 480 by the interpreter, which knows no e4m3 NaN) or
    stray values with NaN scales (INT8), which must stay masked."""
    k, v, table, seq_lens, cu_q = paged_case(lens_k, lens_q, page, hkv, dim, torch.float32,
                                             shared_prefix_blocks=1 if len(lens_k) > 1 else 0)
    shape, dtype = k.shape, DTYPES[kind]
    if kind == "fp8":
        scales = [torch.rand(hkv, device=DEVICE) + 0.02 for _ in range(2)]
    else:
        scales = [torch.empty(shape[0], hkv, page, device=DEVICE) for _ in range(2)]
    cache = KVCache(torch.empty(shape, dtype=dtype, device=DEVICE), torch.empty(shape, dtype=dtype, device=DEVICE),
                    *scales)
    every = torch.arange(shape[0] * page, device=DEVICE)
    ref.reshape_and_cache((k * 4).flatten(0, 1), v.flatten(0, 1), cache, every)
    for i, n in enumerate(lens_k):
        last = int(table[i, (n - 1) // page])
        if n % page and int((table == last).sum()) == 1:  # (not a block another sequence reads whole)
            for c, s in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
                c.view(torch.uint8)[last, n % page:] = 0x7F  # e4m3's NaN; 127 in INT8
                if cache.scaled_per_token:
                    s[last, :, n % page:] = float("nan")
    return cache, table, seq_lens, cu_q


def dequantized(cache: KVCache) -> KVCache:
    every = torch.arange(cache.k.shape[0], device=DEVICE)
    return KVCache(*(x.double() for x in ref.read_pages(cache, every, torch.float32)))


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("lens_k,lens_q,page,hq,hkv,dim,window,splits", PAGED_CASES)
def test_paged_attention_reads_a_quantized_cache(kind, lens_k, lens_q, page, hq, hkv, dim, window, splits):
    """bf16 queries over an FP8 / INT8 cache with its scales, against float64 attention over the cache's
    dequantized values: every path (copy-engine and gathered decode, split-KV, paged prefill)."""
    cache, table, seq_lens, cu_q = quantized_case(kind, lens_k, lens_q, page, hkv, dim)
    q = rand(sum(lens_q), hq, dim, dtype=torch.bfloat16)
    out = tri.paged_attention(q, cache, table, cu_q, seq_lens, max(lens_q), window_size=window, num_splits=splits,
                              out=nan_like(q))
    expected = ref.paged_attention(q.double(), dequantized(cache), table, cu_q, seq_lens, max(lens_q),
                                   window_size=window)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < TOL[torch.bfloat16]
    from flashpage.kernels import cpu
    if lens_q == [1] * len(lens_k):  # the CPU kernel set's batched decode reads the scales too
        host = KVCache(cache.k.cpu(), cache.v.cpu(), cache.k_scale.cpu(), cache.v_scale.cpu())
        got = cpu.paged_attention(q.float().cpu(), host, table.cpu(), cu_q.cpu(), seq_lens.cpu(), 1,
                                  window_size=window)
        assert rel_err(got, expected.cpu()) < 1e-5


@pytest.mark.parametrize("kind", DTYPES)
def test_quantized_decode_scores_that_jump(kind):
    """As test_kernels' test_paged_decode_scores_that_jump, over an 8-bit cache: its copy-engine decode holds the
    even and the odd columns' sums apart, and both must be rescaled."""
    k, v, table, seq_lens, cu_q = paged_case([300, 200], [1, 1], 16, 2, 64, torch.float32)
    q = rand(2, 8, 64, dtype=torch.bfloat16)
    plant_jumps(k, table, q, [(0, 250, 10.0), (0, 280, 14.0), (1, 120, 9.0)], 16)
    shape = k.shape
    scales = ([torch.full((2,), 0.02, device=DEVICE)] * 2 if kind == "fp8" else
              [torch.empty(shape[0], 2, 16, device=DEVICE) for _ in range(2)])
    cache = KVCache(*(torch.empty(shape, dtype=DTYPES[kind], device=DEVICE) for _ in range(2)), *scales)
    ref.reshape_and_cache(k.flatten(0, 1), v.flatten(0, 1), cache, torch.arange(shape[0] * 16, device=DEVICE))
    for splits in (1, 3):
        out = tri.paged_attention(q, cache, table, cu_q, seq_lens, 1, num_splits=splits, out=nan_like(q))
        expected = ref.paged_attention(q.double(), dequantized(cache), table, cu_q, seq_lens, 1)
        assert rel_err(out, expected) < TOL[torch.bfloat16], splits


def test_fp8_cache_clamps_queries_to_fp16():
    """Over an FP8 cache the products run in fp16: a query past fp16's range is clamped to it, so its row stays
    finite (unclamped it becomes inf, and its scores NaN); the other rows are untouched."""
    cache, table, seq_lens, cu_q = quantized_case("fp8", [37, 300], [1, 1], 16, 2, 64)
    q = rand(2, 8, 64, dtype=torch.bfloat16)
    q[0, 1, :5] = 1e6
    for splits in (1, 3):
        out = tri.paged_attention(q, cache, table, cu_q, seq_lens, 1, num_splits=splits, out=nan_like(q))
        assert torch.isfinite(out).all()
        expected = ref.paged_attention(q.double(), dequantized(cache), table, cu_q, seq_lens, 1)
        assert rel_err(out[1], expected[1]) < TOL[torch.bfloat16]


@pytest.mark.parametrize("kind", DTYPES)
def test_cache_writes_quantize_as_the_reference(kind):
    """reshape_and_cache and the fused rotary + cache write store what the reference does: FP8 divided by the
    per-head scale, saturating at 448 (the interpreter converts to e4m3 within one step of the GPU's rounding,
    tests/test_fp8.py); INT8 with each (token, head)'s scale = largest magnitude / 127, values within one step
    (Triton's float32 division is not IEEE-exact)."""
    page, hkv, dim, t = 16, 3, 64, 6
    slots = torch.tensor([0, 17, -1, 95, 40, 41], device=DEVICE)
    k, v = rand(t, hkv, dim, dtype=torch.bfloat16) * 300, rand(t, hkv, dim, dtype=torch.bfloat16) * 3
    k[4, 1] = 0  # a head of zeros: scale 1, values 0
    head_scale = torch.tensor([1.0, 0.5, 2.0], device=DEVICE)

    def cache():
        shape = (6, page, hkv, dim)
        scales = [head_scale.clone() if kind == "fp8" else torch.zeros(6, hkv, page, device=DEVICE) for _ in range(2)]
        return KVCache(torch.zeros(shape, dtype=DTYPES[kind], device=DEVICE),
                       torch.zeros(shape, dtype=DTYPES[kind], device=DEVICE), *scales)

    caches = [cache() for _ in range(3)]
    ref.reshape_and_cache(k, v, caches[0], slots)
    tri.reshape_and_cache(k, v, caches[1], slots)
    ones = torch.ones(t, dim, dtype=torch.bfloat16, device=DEVICE)  # rotation by angle 0: the cache gets k itself
    tri.rope_and_cache(rand(t, 8, dim, dtype=torch.bfloat16), k.clone(), ones, torch.zeros_like(ones), v, caches[2],
                       slots)
    want = caches[0]
    if kind == "fp8":
        assert want.k.float().abs().max() == 448 and torch.isfinite(want.k.float()).all()
    else:
        kept = slots[slots >= 0]
        written = want.k_scale[kept // page, :, kept % page]
        assert want.k.abs().amax((2, 3)).max() == 127 and torch.equal(written[3, 1], torch.tensor(1.0, device=DEVICE))
        back = ref.read_pages(want, torch.arange(6, device=DEVICE), torch.float32)[0].flatten(0, 1)[slots[slots >= 0]]
        assert (back - k[slots >= 0]).norm() / k.norm() < 0.01
    for got in caches[1:]:
        for a, b in ((got.k, want.k), (got.v, want.v)):
            if kind == "fp8":
                assert interpreter_e4m3_agrees(a.float(), b.float()).all()
            else:
                assert (a.int() - b.int()).abs().max() <= 1 and (a == b).float().mean() > 0.99
        if kind == "int8":
            assert torch.allclose(got.k_scale, want.k_scale) and torch.allclose(got.v_scale, want.v_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hkv,dim", [(9, 3, 64), (8, 8, 80), (4, 1, 128), (2, 1, 32)])
def test_fp8_cache_stores_rotated_keys(hq, hkv, dim, dtype):
    """An FP8 cache with keys_rotated: the fused rotary + cache write (and the CPU kernel set's) multiply queries
    and keys by the orthogonal key_rotation after the rotary embedding, so every score q.k is the unrotated one;
    the cache holds the rotated keys, rounded to e4m3 by their head's scale; values go in as they are."""
    from flashpage.kernels import cpu

    rotation = ref.key_rotation(dim)
    assert torch.allclose(rotation @ rotation, torch.eye(dim, dtype=torch.float64), atol=1e-12)
    tokens, page = 7, 8
    q, k, v = rand(tokens, hq, dim, dtype=dtype), rand(tokens, hkv, dim, dtype=dtype) * 4, rand(tokens, hkv, dim, dtype=dtype)
    angles = torch.rand(tokens, dim // 2, device=DEVICE) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    slots = torch.tensor([3, 39, -1, 8, 0, 20, 21], device=DEVICE)
    keep = slots >= 0
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # (bf16: one more rounding; the interpreter's truncates)

    def scores(q, k):  # q.k over |q| |k| (scores near 0 have no relative precision)
        q, k = q.double(), k.double()
        return torch.einsum("thd,tgd->thg", q, k) / (q.norm(dim=-1)[:, :, None] * k.norm(dim=-1)[:, None, :])

    for ops, device in ((tri, DEVICE), (cpu, "cpu")):
        q, k, v, cos, sin, slots = (x.to(device) for x in (q, k, v, cos, sin, slots))
        plain_q, plain_k = ops.rope_and_cache(q.clone(), k.clone(), cos, sin)  # without a cache: not rotated
        cache = KVCache(*(torch.full((5, page, hkv, dim), float("nan"), device=device).to(FP8) for _ in range(2)),
                        *(torch.rand(hkv, device=device) + 0.5 for _ in range(2)), keys_rotated=True)
        got_q, got_k = ops.rope_and_cache(q.clone(), k.clone(), cos, sin, v, cache, slots)
        assert rel_err(got_q, ref.rotate_keys(plain_q)) < tol and rel_err(got_k, ref.rotate_keys(plain_k)) < tol
        assert (scores(got_q, got_k) - scores(plain_q, plain_k)).abs().max() < 2 * tol
        want = KVCache(*(torch.zeros_like(c) for c in (cache.k, cache.v)), cache.k_scale, cache.v_scale)
        ref.reshape_and_cache(got_k, v, want, slots)
        written = slots[keep.to(device)]
        for a, b in ((cache.k, want.k), (cache.v, want.v)):
            a, b = a.view(-1, hkv, dim)[written].float(), b.view(-1, hkv, dim)[written].float()
            assert interpreter_e4m3_agrees(a, b).all()


@pytest.mark.parametrize("kind", DTYPES)
def test_quantized_cache_holds_more_tokens_and_serves_every_feature(kind, smollm_llm):
    """About four times the tokens of a float32 cache in the same memory (INT8: less its scales); batched with
    prefix sharing, n > 1, chunked prefill and preemption, requests start as they do alone over the same cache.
    Not token for token to the end, as with a 16/32-bit cache: a preempted sequence's K/V are recomputed by a
    prefill, whose float32 values differ from the decode's in the last bits, and rounding to 8 bits turns some of
    those into a whole step. A prompt prefilled in chunks differs from one prefilled whole in the same way: on an
    AVX2-only CPU one INT8 greedy sequence of the six went its own way at its fifth token (AVX-512 CPUs: none)."""
    dense = engine_from(smollm_llm, cpu_kv_cache_gb=0.05)
    quantized = engine_from(smollm_llm, cpu_kv_cache_gb=0.05, kv_cache_dtype=kind)
    stats, dense_stats = quantized.stats(), dense.stats()
    ratio = 4 if kind == "fp8" else 4 * 64 / (64 + 4)  # (head dim 64; an INT8 slot's two float32 scales per head)
    assert stats["kv_cache_dtype"] == kind and stats["kv_cache_capacity_tokens"] == 16 * stats["kv_blocks_total"]
    assert int(ratio * dense_stats["kv_blocks_total"]) - 1 <= stats["kv_blocks_total"] <= \
        ratio * (dense_stats["kv_blocks_total"] + 1)  # (each rounded down to whole blocks)
    shared = list(range(200, 248))
    prompts = [shared + [i, i + 1] for i in range(4)] + [[5] * 3]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4 + \
        [SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12)]

    def tokens(engine, prompts, params):
        return [[s.token_ids for s in o.outputs] for o in run(engine, prompts, params)]

    batched = engine_from(smollm_llm, kv_cache_dtype=kind, num_gpu_blocks=8, max_num_batched_tokens=32)
    together = tokens(batched, prompts, params)
    assert batched.stats()["num_preemptions"] > 0 and batched.stats()["prefix_cache_hits"] > 0
    alone = [tokens(engine_from(smollm_llm, kv_cache_dtype=kind), [p], [sp])[0] for p, sp in zip(prompts, params)]
    pairs = [(a, b) for t, u in zip(together, alone) for a, b in zip(t, u, strict=True)]
    assert sum(a[:12] != b[:12] for a, b in pairs) <= 1
    same = sum(x == y for a, b in pairs for x, y in zip(a, b)) / sum(len(b) for _, b in pairs)
    print(f"{kind} cache, batched and preempted against alone: {same:.0%} of the tokens equal")
    assert same > 0.75


def test_copy_on_write_copies_int8_scales(smollm_llm):
    """Two greedy samples of one prompt share its last, partial block until each writes to it: the copy must take
    the block's per-token scales along, or the second sample reads stale ones."""
    engine = engine_from(smollm_llm, kv_cache_dtype="int8")
    out = run(engine, [list(range(300, 321))], [SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True)])
    first, second = (s.token_ids for s in out[0].outputs)
    assert first == second


def test_fp8_scales_from_the_checkpoint(tiny_checkpoints, tmp_path):
    """`self_attn.k_scale` / `v_scale` (vLLM's names; one per layer, or one per KV head) reach the FP8 cache and
    change what it stores; a 16-bit cache ignores them; a bad one is named."""
    src, _ = tiny_checkpoints["llama3-rope-scaling"]
    shutil.copytree(src, tmp_path / "m")
    tensors = load_file(str(src / "model.safetensors"))
    hkv = tensors["model.layers.0.self_attn.k_proj.weight"].shape[0] // 16  # (head dim 16 in the tiny configs)
    per_head = torch.linspace(0.5, 2.0, hkv)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_scale"] = per_head
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    llm = LLM(str(tmp_path / "m"), device="cpu", kv_cache_dtype="fp8")
    caches = llm.engine.runner.kv_caches
    assert torch.equal(caches[0].k_scale, torch.full((hkv,), 0.25)) and torch.equal(caches[0].v_scale, per_head)
    assert torch.equal(caches[1].k_scale, torch.ones(hkv))  # layers the checkpoint gives none: 1
    # keys are stored rotated unless the checkpoint's scales were calibrated on them as they are
    assert not caches[0].keys_rotated and caches[1].keys_rotated
    assert LLM(str(tmp_path / "m"), device="cpu").engine.runner.kv_caches[0].k_scale is None
    tensors["model.layers.0.self_attn.v_scale"] = torch.ones(hkv + 1)
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="self_attn.v_scale.*expected 1 or one per KV head"):
        LLM(str(tmp_path / "m"), device="cpu", kv_cache_dtype="fp8")


def test_kv_cache_dtype_names(tiny_checkpoints):
    """vLLM's fp8_e4m3 is the FP8 cache; a dtype flashpage does not serve (vLLM's fp8_e5m2, say) is named with the
    ones it does, before the model loads."""
    path, _ = tiny_checkpoints["llama3-rope-scaling"]
    llm = LLM(str(path), device="cpu", kv_cache_dtype="fp8_e4m3")
    assert llm.stats()["kv_cache_dtype"] == "fp8" and llm.engine.runner.kv_caches[0].k.dtype == FP8
    for bad in ("fp8_e5m2", "float16", "FP8"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, int8, got '{bad}'"):
            LLM("/nonexistent/model", device="cpu", kv_cache_dtype=bad)


@pytest.mark.parametrize("kind,bound", [("fp8", 1.01), ("int8", 1.02)])
def test_quantized_cache_quality_on_real_text(kind, bound, smollm_llm, smollm_gguf):
    """SmolLM2 on CPython's documentation: perplexity over 2,048 tokens, float32 cache against a quantized one
    (prompt tokens attend to the cache's values, as decode does); the issue's bounds: FP8 +1%, INT8 +2%."""
    from pydoc_data.topics import topics

    ids = smollm_llm.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics))[:30000])[:2048]
    quantized = LLM(str(smollm_gguf), dtype="float32", device="cpu", kv_cache_dtype=kind)
    dense_ppl, q_ppl = perplexity(smollm_llm, ids, 1024), perplexity(quantized, ids, 1024)
    print(f"perplexity float32 cache {dense_ppl:.3f}, {kind} cache {q_ppl:.3f} ({q_ppl / dense_ppl - 1:+.2%})")
    assert q_ppl / dense_ppl < bound
