"""Fused Triton kernels (RMSNorm, SiLU-mul, linear with its neighbours, RoPE+cache write, penalties, sampling)
against their references, through the interpreter on CPU. Fresh random inputs, awkward sizes, outputs poisoned first."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, chi2_limit, rel_err
from flashpage.kernels import reference as ref
from flashpage.kernels import triton_ops as tri
from flashpage.kv import KVCache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (5, 576), (3, 1000)])
def test_rms_norm(tokens, hidden, dtype):
    x, w = rand(tokens, hidden, dtype=dtype), rand(hidden, dtype=dtype)
    out = tri.rms_norm(x, w, 1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref.rms_norm(x, w, 1e-5)) < tol
    assert rel_err(out, ref.rms_norm(x.double(), w.double(), 1e-5)) < tol
    assert tri.rms_norm(x[:0], w, 1e-5).shape == (0, hidden)


def linear_float64(x, weight, bias=None, norm_weight=None, eps=1e-5, silu_mul=False, residual=None):
    """The definition of `linear`, in float64."""
    x, weight = x.double(), weight.double()
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    y = x @ weight.T + (0 if bias is None else bias.double())
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y if residual is None else y + residual.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 40, 100), (5, 33, 700), (16, 64, 64)])
@pytest.mark.parametrize("fused", ["plain", "norm+bias", "norm+silu_mul", "residual", "bias+residual"])
def test_linear(rows, n, k, fused, dtype):
    """The fused kernel (up to 16 rows) and the composed path (here: float32, or 17+ rows) against float64; for
    silu_mul the weight has 2n rows (gate, then up)."""
    silu = "silu" in fused
    x, weight = rand(rows, k, dtype=dtype), rand(2 * n if silu else n, k, dtype=dtype) / k**0.5
    kw = dict(bias=rand(weight.shape[0], dtype=dtype) if "bias" in fused else None,
              norm_weight=rand(k, dtype=dtype) if "norm" in fused else None, eps=1e-5, silu_mul=silu,
              residual=rand(rows, n, dtype=dtype) if "residual" in fused else None)
    want = linear_float64(x, weight, **kw)
    # 16-bit: up to five roundings (norm, gate, silu, up, product), which the interpreter does by truncation (up to
    # 2 ** -7 each in bf16: 3e-2 failed about one run in four)
    tol = 1e-5 if dtype == torch.float32 else 5 * 2**-7 if dtype == torch.bfloat16 else 3e-2
    for impl in (tri, ref):
        got = impl.linear(x, weight, **kw)
        assert got.shape == (rows, n) and got.dtype == dtype and rel_err(got, want) < tol
    logits = tri.linear(x, weight, **kw, out_dtype=torch.float32)  # as the LM head asks
    assert logits.dtype == torch.float32 and rel_err(logits, want) < tol
    tall = rand(17, k, dtype=dtype)  # over the fused kernel's row limit
    tall_kw = {**kw, "residual": rand(17, n, dtype=dtype) if kw["residual"] is not None else None}
    assert rel_err(tri.linear(tall, weight, **tall_kw), linear_float64(tall, weight, **tall_kw)) < tol
    # into a given buffer (a CUDA graph's logits): rows of a wider poisoned one, both paths, every implementation
    for a, a_kw in ((x, kw), (tall, tall_kw)):
        for impl in (tri, ref):
            buf = torch.full((a.shape[0] + 3, n), float("nan"), dtype=torch.float32, device=DEVICE)
            got = impl.linear(a, weight, **a_kw, out_dtype=torch.float32, out=buf[:a.shape[0]])
            assert got.data_ptr() == buf.data_ptr() and rel_err(buf[:a.shape[0]], linear_float64(a, weight, **a_kw)) < tol
            assert buf[a.shape[0]:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        tri.linear(x, weight, **kw, out=torch.empty(rows, n + 1, dtype=dtype))
    assert tri.linear(x[:0], weight, **{**kw, "residual": None}).shape == (0, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 8), (7, 1536), (2, 1500)])
def test_silu_and_mul(tokens, inter, dtype):
    x = rand(tokens, 2 * inter, dtype=dtype) * 3
    out = tri.silu_and_mul(x)
    # 16-bit: two roundings, which the interpreter does by truncation (up to 2 ** -7 each)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert rel_err(out, ref.silu_and_mul(x)) < tol
    assert rel_err(out, ref.silu_and_mul(x.double())) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,dim", [(9, 3, 64), (8, 8, 80), (4, 1, 128)])
def test_rope_and_cache(hq, hkv, dim, dtype):
    tokens, page, blocks = 6, 8, 5
    qkv = rand(tokens, (hq + 2 * hkv) * dim, dtype=dtype)  # q/k/v as views of one fused projection, like the model
    q, k, v = (t.view(tokens, h, dim) for t, h in zip(qkv.split([hq * dim, hkv * dim, hkv * dim], -1), (hq, hkv, hkv)))
    angles = torch.rand(tokens, dim // 2, device=DEVICE) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    want_q, want_k = ref.rope_and_cache(q.double(), k.double(), cos.double(), sin.double())
    k_cache = torch.full((blocks, page, hkv, dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    slots = torch.tensor([3, 39, -1, 8, 0, 20], device=DEVICE)
    v_before, q_before, k_before = v.clone(), q.clone(), k.clone()
    got_q, got_k = tri.rope_and_cache(q, k, cos, sin, v, KVCache(k_cache, v_cache), slots)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert got_q.data_ptr() == q.data_ptr() and rel_err(got_q, want_q) < tol and rel_err(got_k, want_k) < tol
    assert torch.equal(v, v_before)
    flat_k, flat_v = k_cache.view(-1, hkv, dim), v_cache.view(-1, hkv, dim)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], got_k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()
    q2, k2 = tri.rope_and_cache(q_before, k_before, cos, sin)  # without a cache
    assert torch.equal(q2, got_q) and torch.equal(k2, got_k)


def test_penalties():
    vocab = 50
    logits = rand(3, vocab)
    rows = torch.tensor([0, 0, 0, 2, 2], dtype=torch.int32, device=DEVICE)
    tokens = torch.tensor([4, 7, 49, 0, 7], device=DEVICE)
    counts = torch.tensor([0, 3, 1, 2, 0], dtype=torch.int32, device=DEVICE)
    rep, pres, freq = (torch.tensor(v, device=DEVICE) for v in ([1.3, 1.0, 0.7], [0.5, 0.0, -0.2], [0.25, 0.0, 0.1]))
    want = logits.clone()
    for r, t, c in zip(rows.tolist(), tokens.tolist(), counts.tolist()):  # the definition, entry by entry
        x = want[r, t]
        x = x / rep[r] if x > 0 else x * rep[r]
        want[r, t] = x - pres[r] * (c > 0) - freq[r] * c
    got = logits.clone()
    tri.apply_penalties(got, rows, tokens, counts, rep, pres, freq)
    assert torch.allclose(got, want, atol=1e-6)
    got = logits.clone()
    ref.apply_penalties(got, rows, tokens, counts, rep, pres, freq)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("vocab", [1, 31, 33, 5000])
def test_token_bitmask(vocab):
    """Bit t % 32 of word t // 32 allows token t; the definition token by token, over random masks and rows left
    all-allowed (-1)."""
    logits = rand(4, vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, words), dtype=torch.int32, device=DEVICE)
    bitmask[2] = -1
    want = logits.clone()
    for r in range(4):
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    assert want[2].isfinite().all() and (vocab < 100 or not want.isfinite().all())
    for ops in (tri, ref):
        got = logits.clone()
        ops.apply_token_bitmask(got, bitmask)
        assert torch.equal(got, want)
    tri.apply_token_bitmask(logits[:0], bitmask[:0])


def sampling_args(batch, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, vocab=None, seed=0):
    full = lambda v, dt: torch.full((batch,), v, dtype=dt, device=DEVICE)  # noqa: E731
    seeds = torch.arange(batch, dtype=torch.int64, device=DEVICE) * 7919 + seed
    return (full(temperature, torch.float32), full(top_k or vocab, torch.int32), full(top_p, torch.float32),
            full(min_p, torch.float32), seeds)


def test_sample_greedy_and_top_k_1_take_the_first_maximum():
    logits = rand(5, 300)
    logits[1, 10] = logits[1, 250] = logits[1].max() + 1  # a tie: the first one wins, as torch.argmax
    want = logits.argmax(-1)
    want_lp = torch.log_softmax(logits.double(), -1).gather(-1, want[:, None])[:, 0]
    for impl, kw in [(tri, dict(temperature=0.0)), (tri, dict(top_k=1)), (ref, dict(temperature=0.0))]:
        tokens, logprobs = impl.sample(logits, *sampling_args(5, vocab=300, **kw))
        assert torch.equal(tokens, want) and rel_err(logprobs, want_lp) < 1e-6
    assert tri.sample(logits[:0], *sampling_args(0, vocab=300))[0].shape == (0,)


@pytest.mark.parametrize("vocab,chunks", [(300, None), (2500, None), (2500, 4)])
def test_greedy_takes_the_first_maximum_and_its_log_probability(vocab, chunks):
    """The greedy kernel (the sampling kernel's chunk statistics and finish alone): ties go to the first maximum,
    also across chunks (2500 logits: two or four chunks), and log-probabilities are those of a float64 softmax."""
    logits = rand(4, vocab) * 3
    logits[1, 10] = logits[1, vocab - 7] = logits[1].max() + 1  # a tie across chunks
    logits[2, vocab - 1] = logits[2].max() + 1  # the last logit (the last chunk's tail)
    want = logits.double().argmax(-1)
    want_lp = torch.log_softmax(logits.double(), -1).gather(-1, want[:, None])[:, 0]
    for got in (tri.greedy(logits, chunks=chunks), ref.greedy(logits)):
        assert torch.equal(got[0], want) and rel_err(got[1], want_lp) < 1e-6
    assert want[1] == 10
    empty = tri.greedy(logits[:0])
    assert empty[0].shape == empty[1].shape == (0,)


def test_sample_seeds_decide_rows_independently():
    logits = rand(1, 97).expand(6, 97).contiguous()
    args = sampling_args(6, vocab=97)
    a, lp = tri.sample(logits, *args)
    b = tri.sample(logits[2:3], *(x[2:3] for x in args))[0]
    assert a[2] == b[0] and torch.equal(a, tri.sample(logits, *args)[0])
    assert rel_err(lp, torch.log_softmax(logits.double(), -1).gather(-1, a[:, None])[:, 0]) < 1e-6


def test_sample_does_not_depend_on_how_rows_are_cut():
    """Each token's race noise is keyed by (seed, token id), so one, two or four chunks draw the same tokens."""
    logits = rand(3, 2500) * 2
    args = sampling_args(3, vocab=2500, temperature=1.3, seed=int(torch.randint(1 << 30, ())))
    draws = [tri.sample(logits, *args, filtered=False, chunks=n)[0] for n in (1, 2, 4)]
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])


# The interpreter runs one program in 30-200 ms, so on CPU fewer draws and cases; on a GPU all five with 20k draws.
CASES = [dict(temperature=0.7), dict(top_k=8, top_p=0.8, min_p=0.05, temperature=0.9)]
if DEVICE == "cuda":
    CASES += [dict(top_k=5), dict(top_p=0.6, temperature=1.3), dict(min_p=0.2)]


@pytest.mark.parametrize("kw", CASES)
def test_sample_matches_the_filtered_distribution(kw):
    """Chi-square of many draws (one seed each) against the exact filtered softmax, at the 99.9% level."""
    vocab = 12
    draws = 20000 if DEVICE == "cuda" else (500 if len(kw) == 1 else 150)
    row = torch.randn(vocab, device=DEVICE) * 1.5
    logits = row.expand(draws, vocab).contiguous()
    args = sampling_args(draws, vocab=vocab, seed=int(torch.randint(1 << 30, ())), **kw)
    probs = ref.filter_probs(torch.softmax(row[None] / kw.get("temperature", 1.0), -1), *(a[:1] for a in args[1:4]))[0]
    probs = (probs / probs.sum()).cpu().double()
    got = torch.bincount(tri.sample(logits, *args)[0], minlength=vocab).cpu().double()
    kept = probs > 0
    assert got[~kept].sum() == 0, "sampled a filtered-out token"
    expected = probs[kept] * draws
    assert ((got[kept] - expected) ** 2 / expected).sum().item() <= chi2_limit(int(kept.sum()) - 1)


@pytest.mark.parametrize("vocab,chunks,lift,kw", [(300, None, 2, dict(top_k=7)), (300, None, 2, dict(top_p=0.12)),
                                                  (300, None, 20, dict(top_k=7)),  # the cluster's e < 2^-24
                                                  (2500, 2, 2, dict(top_k=40, top_p=0.075, temperature=0.5))])
def test_sample_keeps_exactly_the_filtered_tokens(vocab, chunks, lift, kw):
    """Three logits `lift` above a cluster of logits a hair apart, where the kept set ends: the thresholds' search
    must resolve e = exp((x - max) / T) to its last bits, and count what lies above its bracket. Which tokens
    the kernel keeps, read exactly: a draft token proposed with q = 0 is accepted (min(1, p / q)) exactly when its
    p > 0. One row per candidate (the likeliest few dozen and some others), against the sorted reference."""
    row = 5 + torch.randn(vocab, device=DEVICE) * 0.01
    row[torch.randperm(vocab, device=DEVICE)[:3]] += lift
    order = row.argsort(descending=True)
    candidates = torch.cat([order[:64], order[64:][torch.randperm(vocab - 64, device=DEVICE)[:16]]])
    rows = len(candidates)
    args = sampling_args(rows, vocab=vocab, seed=int(torch.randint(1 << 30, ())), **kw)
    want = ref.filtered_probs(row[None], *(a[:1] for a in args[:4]))[0][candidates] > 0
    got = tri.sample(row.expand(rows, vocab).contiguous(), *args, chunks=chunks, draft_tokens=candidates,
                     draft_probs=torch.zeros(rows, vocab, device=DEVICE))[0]
    assert 6 < want.sum() < 60
    assert torch.equal(got == candidates, want)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 tensor-core products on a model of real shape need a GPU")
def test_decode_linear_keeps_bf16_logits_as_close_to_float32_as_cublas():
    """llama-3.2-1b shapes, random weights: decode-sized batches (1-16 rows, so the fused decode linear) through the
    Triton kernel set and through the PyTorch references (cuBLAS), both in bf16, against the same weights computed
    in float32. The fused path may not be less accurate than cuBLAS."""
    from flashpage.loader import load_model
    from flashpage.model import AttentionMetadata

    m16 = load_model("llama-3.2-1b", load_format="dummy", dtype="bfloat16", device="cuda").model
    m32 = load_model("llama-3.2-1b", load_format="dummy", dtype="float32", device="cuda").model
    with torch.no_grad():
        for a, b in zip(m32.parameters(), m16.parameters()):
            a.copy_(b)
    for rows in (1, 5, 16):
        ids = torch.randint(m16.config.vocab_size, (rows,), device="cuda")
        positions = torch.randint(0, 500, (rows,), device="cuda")
        meta = AttentionMetadata.prefill([1] * rows, "cuda", positions)
        with torch.inference_mode():
            want = m32.compute_logits(m32(ids, meta))
            errors = {}
            for kernels in ("triton", "torch"):
                m16.set_kernels(kernels)
                errors[kernels] = rel_err(m16.compute_logits(m16(ids, meta)), want)
        assert errors["triton"] < min(1.25 * errors["torch"], 5e-2), errors
