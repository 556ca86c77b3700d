"""Sparse attention (`sparse_attention`, opt-in and lossy): SparQ's reference against the paper's algorithm written
plainly, its Triton kernels and cache extras against the reference, and the engine over it (settings, errors,
prefix caching, copy-on-write, preemption, stats)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, engine_from, rel_err
from flashpage import SamplingParams
from flashpage.engine.inputs import block_sparse_view
from flashpage.engine.sparse import AXIS_WEIGHT, key_bases, sparq_turns
from flashpage.errors import ParameterError
from flashpage.kernels import cpu as cpu_kernels
from flashpage.kernels import reference as ref
from flashpage.kernels import sparq, topk
from flashpage.kernels import triton_ops as tri
from flashpage.kernels.block_sparse import BlockSparsePattern, choose_blocks
from flashpage.kv import KVCache, allocate_kv_caches
from test_engine import run
from test_kernels import TOL, paged_case


def sparq_by_the_paper(q, keys, values, r, k, scale, basis=None, query_basis=None, recent=0):
    """One query [Hq, D] over keys/values [L, Hkv, D], float64, head by head as Algorithm 1 of the paper reads,
    the group sharing components (|q| summed) and keys (approximate probabilities summed); with `basis` [Hkv, D,
    D], the components of q and the keys in it (their columns) for the approximate scores; with `query_basis` too,
    q's in that one instead. The keys' components that approximate the scores are rounded to e4m3 (saturated at
    +-448), as SparQ's copy of the keys holds them. `recent`: the last so many keys chosen first."""
    hq, hkv = q.shape[0], keys.shape[1]
    group, length = hq // hkv, keys.shape[0]
    out = torch.empty_like(q)
    for h in range(hkv):
        qs = q[h * group:(h + 1) * group]
        turn = basis[h] if basis is not None else torch.eye(q.shape[1], dtype=q.dtype)
        q_turn = query_basis[h] if query_basis is not None else turn
        comp = (qs @ q_turn).abs().sum(0).topk(r).indices
        probs = []
        for qh in qs:
            qt = qh @ q_turn
            temp = scale / (qt[comp].abs().sum() / qt.abs().sum()).sqrt()
            stored = (keys[:, h] @ turn).clamp(-448, 448).to(torch.float8_e4m3fn).to(q.dtype)
            probs.append(torch.softmax(stored[:, comp] @ qt[comp] * temp, 0))
        ranks = torch.stack(probs).sum(0)
        ranks[length - min(recent, length):] = float("inf")
        chosen = ranks.topk(min(k, length)).indices
        for g, qh in enumerate(qs):
            alpha = probs[g][chosen].sum() if length > k else 1.0
            exact = torch.softmax(keys[chosen, h] @ qh * scale, 0) @ values[chosen, h]
            out[h * group + g] = alpha * exact + (1 - alpha) * values[:, h].mean(0)
    return out


def random_basis(hkv, dim, dtype=torch.float32):
    """An orthonormal basis per KV head [Hkv, D, D] (its columns)."""
    return torch.linalg.qr(torch.randn(hkv, dim, dim, dtype=torch.float64)).Q.to(dtype).to(DEVICE)


def sparq_cache(lens_k, page, hkv, dim, dtype, writer, basis=None, axes=0, key_bits=8):
    """A shuffled paged cache with its SparQ extras poisoned, then written by `writer` (the reference's or the
    Triton kernel's) as a prefill of each sequence's first third and decode steps of the rest, one token each;
    `basis`: the cache's sparq_basis; `axes`: so many value axes (random orthonormal ones, random RMS); `key_bits`:
    its key copy's."""
    k, v, table, seq_lens, _ = paged_case(lens_k, [1] * len(lens_k), page, hkv, dim, dtype)
    cache = allocate_kv_caches(1, k.shape[0], page, hkv, dim, dtype, torch.device(DEVICE), sparq=True,
                               value_axes=axes, key_bits=key_bits)[0]
    cache.sparq_basis = basis
    cache.k.copy_(k)
    cache.v.copy_(v)
    if key_bits == 4:  # (the codes 15 and the scales NaN)
        cache.k_t.fill_(255)
        cache.k_t_scale.fill_(float("nan"))
    else:
        cache.k_t.fill_(float("nan"))
    cache.v_cumsum.fill_(float("nan"))
    if axes:  # (from a generator of their own: the cases' other draws stay as they were without axes)
        g = torch.Generator().manual_seed(axes)
        turn = torch.linalg.qr(torch.randn(hkv, dim, dim, dtype=torch.float64, generator=g)).Q
        cache.sparq_value_axes = turn[..., :axes].float().contiguous().to(DEVICE)
        cache.sparq_value_rms = (torch.rand(hkv, axes, generator=g) * 0.5 + 0.1).to(DEVICE)
        cache.v_t.fill_(float("nan"))
    prefilled = [max(1, n // 3) for n in lens_k]
    steps = [[range(0, d) for d in prefilled]]
    steps += [[range(d + t, d + t + 1) if d + t < n else range(0) for d, n in zip(prefilled, lens_k)]
              for t in range(max(lens_k) - min(prefilled))]
    for step in steps:  # (a sequence with nothing new in a step has no tokens and no keys in it)
        slots = torch.tensor([int(table[i, p // page]) * page + p % page for i, r in enumerate(step) for p in r],
                             dtype=torch.int64, device=DEVICE)
        cu = torch.tensor([0] + [len(r) for r in step], device=DEVICE).cumsum(0).int()
        lens = torch.tensor([r.stop if len(r) else 0 for r in step], dtype=torch.int32, device=DEVICE)
        writer(cache.k.view(-1, hkv, dim)[slots], cache, slots, table, cu, lens)
    return cache, table, seq_lens


def check_sparq_extras(cache, table, seq_lens):
    """k_t holds every written key (in the cache's sparq_basis), component-major, rounded to e4m3 (or to 4 bits
    with its scale, two keys a byte); each block's v_cumsum the sum of its sequence's values up to the block's last
    written slot; v_t (with value axes) each value's coordinates along them over their RMS, rounded to e4m3."""
    page, bits = cache.block_size, cache.sparq_key_bits
    for i, n in enumerate(seq_lens.tolist()):
        blocks = table[i, :-(-n // page)].long()
        slots = torch.arange(n, device=DEVICE)
        keys = cache.k[blocks[slots // page], slots % page]
        stored = ref.read_sparq_copy(cache, blocks)[:n].double()
        if cache.sparq_basis is None:
            assert torch.equal(stored, ref.as_sparq_copy(keys.double(), bits))
        else:  # (turned in float32 by the kernel: a value near a rounding boundary may round the other way)
            turned = ref.in_basis(keys.double(), cache.sparq_basis.double())
            assert (stored == ref.as_sparq_copy(turned, bits)).double().mean() > 0.99
            low, high = {8: (0.01, 2**-4), 4: (0.1, 0.25)}[bits]  # rounded to e4m3 or to 4 bits, and no more
            assert low < rel_err(stored, turned) < high
        if cache.v_t is not None:
            stored = cache.v_t[blocks[slots // page], :, slots % page].double()
            coords = torch.einsum("thd,hdm->thm", cache.v[blocks[slots // page], slots % page].double(),
                                  cache.sparq_value_axes.double()) / cache.sparq_value_rms.double()
            assert (stored == ref.as_sparq_copy(coords)).double().mean() > 0.99
            assert 0.005 < rel_err(stored.transpose(0, 2), coords.transpose(0, 2)) < 2**-4  # (over the tokens)
        values = cache.v[blocks].double().flatten(0, 1)[:n].cumsum(0)
        ends = torch.clamp((torch.arange(len(blocks), device=DEVICE) + 1) * page, max=n) - 1
        assert rel_err(cache.v_cumsum[blocks], values[ends]) < 1e-6


CASES = [
    # (k lengths, Hq, Hkv, D, page, r, k, splits (scores, attention), value axes, recent keys always chosen, bits of
    # the key copy)
    ([1, 300], 4, 4, 64, 16, 8, 16, None, 0, 0, 8),  # a one-token sequence; MHA
    ([37, 5, 300], 8, 2, 64, 16, 8, 24, (3, 2), 4, 5, 8),  # short ones see every key; splits
    ([200, 129], 9, 3, 64, 8, 16, 40, (4, 3), 4, 40, 8),  # SmolLM2's group of 3, pages of 8; the last k keys
    ([150], 6, 2, 80, 16, 10, 32, (2, 2), 3, 0, 8),  # head dim 80; three axes (padded)
    ([260, 33], 8, 1, 128, 32, 16, 64, None, 0, 7, 8),  # MQA, large pages
    ([200, 70], 4, 2, 64, 64, 8, 24, (2, 2), 1, 0, 8),  # pages of 64: a tile of the scores is one page
    ([300, 129], 4, 2, 64, 128, 8, 24, (2, 2), 2, 8, 8),  # pages of 128: a tile of the scores is one page of 128
    ([150, 97, 150, 133, 150], 2, 1, 128, 16, 16, 64, (1, 64), 8, 3, 8),  # more attention splits than tiles; the
    # combine in 64-column programs (five sequences: the 16-bit test asks most groups, not all, to match)
    # the key copy in 4 bits (pages of 64 only): "1/8 v2 r8" in 4 bits at SmolLM2's shape; odd lengths, 12
    # components; head dim 128, 52 components, a one-token sequence
    ([200, 71], 9, 3, 64, 64, 26, 24, (2, 2), 2, 8, 4),
    ([37, 5, 301], 8, 2, 64, 64, 12, 24, (3, 2), 0, 0, 4),
    ([1, 129], 4, 2, 128, 64, 52, 16, None, 0, 3, 4),
]


def test_reference_is_the_papers_algorithm(monkeypatch):
    """The batched reference, row by row and multi-row, against the algorithm written plainly in float64."""
    torch.manual_seed(0)
    hq, hkv, dim, length, r, k = 6, 2, 32, 90, 8, 20
    keys, values = torch.randn(length, hkv, dim, dtype=torch.float64), torch.randn(length, hkv, dim,
                                                                                   dtype=torch.float64)
    cache = KVCache(keys[None].clone(), values[None].clone())  # one block of 90 (the reference reads any page)
    q = torch.randn(length, hq, dim, dtype=torch.float64)
    table = torch.zeros(1, 1, dtype=torch.int32)
    out = ref.sparq_attention(q, cache, table, torch.tensor([0, length]), torch.tensor([length]), length, r=r, k=k,
                              rows_per_chunk=16)
    for pos in (0, 5, k - 1, k, 47, length - 1):
        want = sparq_by_the_paper(q[pos], keys[:pos + 1], values[:pos + 1], r, k, dim**-0.5)
        assert rel_err(out[pos], want) < 1e-12, pos
        one = ref.sparq_attention(q[pos:pos + 1], cache, table, torch.tensor([0, 1]), torch.tensor([pos + 1]), 1,
                                  r=r, k=k)
        assert rel_err(one[0], want) < 1e-12, pos
    dense = ref.paged_attention(q[-1:], cache, table, torch.tensor([0, 1]), torch.tensor([length]), 1)
    assert rel_err(out[-1:], dense) > 0.05  # (k < length: it is sparse)
    for recent in (6, k):  # the last keys always chosen: some, and all k (a window)
        out_r = ref.sparq_attention(q, cache, table, torch.tensor([0, length]), torch.tensor([length]), length, r=r,
                                    k=k, recent=recent, rows_per_chunk=16)
        for pos in (5, k, 47, length - 1):
            want = sparq_by_the_paper(q[pos], keys[:pos + 1], values[:pos + 1], r, k, dim**-0.5, recent=recent)
            assert rel_err(out_r[pos], want) < 1e-12, (recent, pos)
        assert rel_err(out_r[k:], out[k:]) > 1e-3  # (other keys chosen)
    basis = torch.linalg.qr(torch.randn(hkv, dim, dim, dtype=torch.float64)).Q
    turned = KVCache(cache.k, cache.v, sparq_basis=basis)
    out_b = ref.sparq_attention(q, turned, table, torch.tensor([0, length]), torch.tensor([length]), length, r=r,
                                k=k)
    for pos in (5, k, 47, length - 1):
        want = sparq_by_the_paper(q[pos], keys[:pos + 1], values[:pos + 1], r, k, dim**-0.5, basis)
        assert rel_err(out_b[pos], want) < 1e-12, pos
    assert rel_err(out_b[k:], out[k:]) > 1e-3  # (another basis, other components and keys)
    w = torch.rand(hkv, 1, dim, dtype=torch.float64) + 0.5  # the axes scaled: 1 / w for keys, w for queries
    scaled = KVCache(cache.k, cache.v, sparq_basis=basis / w, sparq_query_basis=basis * w)
    out_w = ref.sparq_attention(q, scaled, table, torch.tensor([0, length]), torch.tensor([length]), length, r=r,
                                k=k)
    for pos in (5, k, 47, length - 1):
        want = sparq_by_the_paper(q[pos], keys[:pos + 1], values[:pos + 1], r, k, dim**-0.5, basis / w, basis * w)
        assert rel_err(out_w[pos], want) < 1e-12, pos
    assert rel_err(out_w[k:], out_b[k:]) > 1e-3
    with monkeypatch.context() as m:  # all components of keys not rounded: exact scores, in any basis
        m.setattr(ref, "as_sparq_copy", lambda keys, bits=8: keys)
        every = [ref.sparq_attention(q, c, table, torch.tensor([0, length]), torch.tensor([length]), length, r=dim,
                                     k=k) for c in (cache, turned)]
    assert rel_err(every[0], every[1]) < 1e-12


def test_key_bases_are_principal_axes():
    """key_bases: orthonormal, and the keys' second moment in it falls from the first component to the last."""
    torch.manual_seed(0)
    keys = torch.randn(500, 2, 16) * torch.logspace(1, -1, 16)
    keys = ref.in_basis(keys, random_basis(2, 16).cpu())  # (the large axes off the coordinate axes)
    basis = key_bases(keys)
    assert basis.shape == (2, 16, 16) and basis.dtype == torch.float32
    assert (basis.transpose(1, 2) @ basis - torch.eye(16)).abs().max() < 1e-5
    moments = ref.in_basis(keys, basis).pow(2).mean(0)  # [Hkv, D]
    assert bool((moments[:, :-1] >= moments[:, 1:] * (1 - 1e-5)).all())
    assert bool((moments[:, 0] > 50 * moments[:, -1]).all())
    # SparQ's turns: q''.k'' = q.k, and the queries' components weighed by the keys' RMS along their axes
    key_turn, query_turn = sparq_turns(keys)
    q = torch.randn(7, 2, 16)
    assert rel_err(torch.einsum("qhd,khd->hqk", ref.in_basis(q, query_turn), ref.in_basis(keys, key_turn)),
                   torch.einsum("qhd,khd->hqk", q, keys)) < 1e-5
    weights = ref.in_basis(q, query_turn) / ref.in_basis(q, basis)  # [7, Hkv, D]: the same for every query
    assert rel_err(weights, (moments.sqrt() ** AXIS_WEIGHT).expand_as(weights)) < 1e-4


@pytest.mark.parametrize("lens_k,hq,hkv,dim,page,r,k,splits,axes,recent,bits", CASES)
@pytest.mark.parametrize("turned", [False, True])
def test_triton_sparq_matches_reference(lens_k, hq, hkv, dim, page, r, k, splits, axes, recent, bits, turned,
                                        monkeypatch):
    """The Triton cache extras (written by a prefill and decode steps) equal the reference's, and the kernels'
    output the reference's in float64, within float32 rounding; a padding sequence (no keys) gives zeros;
    `turned`: in a random basis of each KV head, and the keys chosen by the chunked select that long rows take (in
    chunks of 64, its first digits counted by the aggregation, here in programs of 32 keys); `strided` (K read
    instead of the copy) SparQ over unrounded keys; `axes`: with so many value axes; `recent`: the last so many
    keys always chosen; `bits`: the key copy's."""
    torch.manual_seed(sum(lens_k) + r)
    basis = query_basis = None
    if turned:  # the engine's kind: an orthonormal basis, its axes scaled by w for queries and 1 / w for keys
        turn, w = random_basis(hkv, dim), torch.rand(hkv, 1, dim, device=DEVICE) + 0.5
        basis, query_basis = turn / w, turn * w
        monkeypatch.setattr(topk, "MAX_ROW", 0)
        monkeypatch.setattr(topk, "CHUNK", 64)
        monkeypatch.setattr(sparq, "AGGREGATE_KEYS", 32)  # the tail summed over many programs, added 4 at a time
        monkeypatch.setattr(sparq, "TAIL_ROWS", 4)
        # the select's histograms come unzeroed (poisoned here): the scores kernel zeroes them
        unzeroed = sparq.digit_counts

        def poisoned(values, chunk, zeroed=True, drop_bits=0):  # (the chunks' counts are written whole: poisoned too)
            counts = unzeroed(values, chunk, zeroed, drop_bits)
            counts.hist.fill_(0 if zeroed else 12345)
            counts.chunk_hist.fill_(-999)
            counts.chunk_above.fill_(-999)
            return counts
        monkeypatch.setattr(sparq, "digit_counts", poisoned)
    torch.manual_seed(sum(lens_k) + r + 2)  # (the same cache for both writers, to compare their bytes)
    expected, table, seq_lens = sparq_cache(lens_k, page, hkv, dim, torch.float32, ref.write_sparq_copies, basis,
                                            axes, bits)
    check_sparq_extras(expected, table, seq_lens)
    torch.manual_seed(sum(lens_k) + r + 2)
    cache, table, seq_lens = sparq_cache(lens_k, page, hkv, dim, torch.float32, sparq.write_sparq_copies, basis,
                                         axes, bits)
    cache.sparq_query_basis = query_basis
    check_sparq_extras(cache, table, seq_lens)
    if bits == 4 and not turned:  # byte for byte, each key's nibble and its neighbour's kept (or poison)
        assert torch.equal(cache.k_t, expected.k_t)
        assert torch.equal(cache.k_t_scale.view(torch.uint8), expected.k_t_scale.view(torch.uint8))
    q = torch.randn(len(lens_k) + 1, hq, dim, device=DEVICE)
    table = torch.cat([table, torch.zeros_like(table[:1])])
    seq_lens = torch.cat([seq_lens, torch.zeros_like(seq_lens[:1])])
    cu = torch.arange(len(lens_k) + 2, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    sparq.sparq_attention(q, cache, table, cu, seq_lens, 1, r=r, k=k, recent=recent, num_splits=splits, out=out)
    # (the reference reads the kernel's copy: checked above, and a key's component on a rounding boundary may round
    # the other way in float64, which can change the choice of keys)
    double = dataclasses.replace(cache, k=cache.k.double(), v=cache.v.double())
    expect = ref.sparq_attention(q[:-1].double(), double, table[:-1], cu[:-1], seq_lens[:-1], 1, r=r, k=k,
                                 recent=recent)
    assert rel_err(out[:-1], expect) < 1e-5
    if turned:
        with pytest.raises(ValueError, match="sparq_basis"):
            sparq.sparq_attention(q, cache, table, cu, seq_lens, 1, r=r, k=k, strided=True)
    else:  # the components read from K itself: SparQ over keys as they are, not rounded to e4m3
        strided = sparq.sparq_attention(q, cache, table, cu, seq_lens, 1, r=r, k=k, recent=recent, num_splits=splits,
                                        strided=True)
        with monkeypatch.context() as m:
            m.setattr(ref, "as_sparq_copy", lambda keys, bits=8: keys)
            unrounded = ref.sparq_attention(q[:-1].double(), KVCache(double.k, double.v, v_t=double.v_t,
                                            sparq_value_axes=cache.sparq_value_axes,
                                            sparq_value_rms=cache.sparq_value_rms), table[:-1], cu[:-1],
                                            seq_lens[:-1], 1, r=r, k=k, recent=recent)
        assert rel_err(strided[:-1], unrounded) < 1e-5
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    if max(lens_k) > k:
        dense = ref.paged_attention(q[:-1].double(), double, table[:-1], cu[:-1], seq_lens[:-1], 1)
        assert rel_err(out[:-1], dense) > 1e-3


@pytest.mark.parametrize("lens_k,hq,hkv,dim,page,r,k,splits,axes,recent,bits", CASES)
@pytest.mark.parametrize("turned", [False, True])
def test_triton_sparq_16bit(lens_k, hq, hkv, dim, page, r, k, splits, axes, recent, bits, turned):
    """Over a bf16 cache the kernels keep the approximate scores and their sums in fp16 and rank the sums by their
    top 10 bits (the reference too, from its float64 sums), which can swap keys that fall on either side of a
    rounding boundary; on random keys (flat attention) one swap moves a group's output by up to a third. So most (sequence, KV head) groups, not all, match the float64 reference on the same bf16 values
    to bf16 rounding, and none is garbage. `turned`: in a basis of each KV head that bf16 holds exactly, a random
    signed permutation (a general one rounds the turned queries and keys, as the float32 test measures)."""
    torch.manual_seed(sum(lens_k) + r + 1)
    signs = torch.randint(0, 2, (hkv, 1, dim)) * 2 - 1
    perms = torch.stack([torch.eye(dim)[torch.randperm(dim)] for _ in range(hkv)])
    basis = (perms * signs).bfloat16().to(DEVICE) if turned else None
    cache, table, seq_lens = sparq_cache(lens_k, page, hkv, dim, torch.bfloat16, sparq.write_sparq_copies, basis, axes,
                                         bits)
    q = torch.randn(len(lens_k), hq, dim, device=DEVICE).bfloat16()
    cu = torch.arange(len(lens_k) + 1, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    sparq.sparq_attention(q, cache, table, cu, seq_lens, 1, r=r, k=k, recent=recent, num_splits=splits, out=out)
    double = dataclasses.replace(cache, k=cache.k.double(), v=cache.v.double())
    expect = ref.sparq_attention(q.double(), double, table, cu, seq_lens, 1, r=r, k=k, recent=recent,
                                 drop_bits=sparq.FP16_DROP_BITS)
    g = hq // hkv
    errs = [rel_err(out[i, h * g:(h + 1) * g], expect[i, h * g:(h + 1) * g]) for i in range(len(lens_k))
            for h in range(hkv)]
    assert max(errs) < 0.5 and sum(e < 1e-2 for e in errs) >= 0.8 * len(errs), errs


SPARQ = {"method": "sparq", "r": 16, "k": 24}


def real_text(llm, n, start=0):
    """n tokens of CPython's documentation."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return llm.tokenizer.encode(text[start:start + 8 * n])[:n]


def tokens(engine, prompts, params):
    return [[s.token_ids for s in o.outputs] for o in run(engine, prompts, params)]


def test_sparq_engine(smollm_llm):
    """Decoding with SparQ: identical to dense where k covers the context, different where it does not; a request
    decoded beside another's prefill (the step's mixed path) gets what it gets alone; stats count what it read;
    its cache extras take less than a second copy of the cache."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = real_text(smollm_llm, 60)
    dense = tokens(engine_from(smollm_llm), [prompt], [greedy])[0][0]
    # (the paper's basis where the basis does not matter: the default's calibration is a 4k-token prefill)
    paper = {**SPARQ, "basis": "none"}
    assert tokens(engine_from(smollm_llm, sparse_attention={**paper, "k": 512}), [prompt], [greedy])[0][0] == dense
    engine = engine_from(smollm_llm, sparse_attention=SPARQ)
    alone = tokens(engine, [prompt], [greedy])[0][0]
    assert alone != dense
    stats = engine.stats()
    contexts = range(len(prompt) + 1, len(prompt) + 24)  # (the first token comes from the prefill)
    assert stats["sparse_attention_keys_fraction"] == pytest.approx(24 * len(contexts) / sum(contexts))
    # (r one-byte components of keys of 64 float32 values, K and V)
    approx = 16 / (2 * 64 * engine.runner.kv_caches[0].k.element_size())
    assert stats["sparse_attention_bytes_fraction"] == pytest.approx(approx + 24 * len(contexts) / sum(contexts))
    engine.add_request("a", prompt, greedy)
    for _ in range(4):
        engine.step()
    engine.add_request("b", real_text(smollm_llm, 100, start=5000), greedy)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["a"].outputs[0].token_ids == alone
    caches = engine.runner.kv_caches  # each layer's basis, from the calibration text's keys (key_bases)
    assert all(c.sparq_basis.shape == (3, 64, 64) for c in caches) and rel_err(caches[0].sparq_basis,
                                                                              caches[1].sparq_basis) > 0.1
    assert all((c.sparq_query_basis.transpose(1, 2) @ c.sparq_basis - torch.eye(64)).abs().max() < 1e-3
               for c in caches)  # (the queries' turn keeps q.k)
    paper_engine = engine_from(smollm_llm, sparse_attention=paper)
    assert all(c.sparq_basis is None for c in paper_engine.runner.kv_caches)
    scored = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    logprobs = [[next(iter(d.values())).logprob for d in run(e, [prompt], [scored])[0].outputs[0].logprobs]
                for e in (engine, paper_engine)]
    assert max(abs(a - b) for a, b in zip(*logprobs)) > 1e-3  # (the basis changes what SparQ attends to)
    assert engine.bm.block_size == 64 and engine_from(smollm_llm).bm.block_size == 16  # (the defaults)
    assert engine_from(smollm_llm, sparse_attention=SPARQ, block_size=16).bm.block_size == 16
    plain = engine_from(smollm_llm, cpu_kv_cache_gb=0.25).stats()["kv_cache_capacity_tokens"]
    for block_size in (16, 64):
        with_extras = engine_from(smollm_llm, cpu_kv_cache_gb=0.25, sparse_attention=paper,
                                  block_size=block_size).stats()["kv_cache_capacity_tokens"]
        # (float32 K + V: 8 bytes a value; K again in e4m3: 1; a float32 sum per block and head: 4 / block_size)
        assert with_extras / plain == pytest.approx(8 / (9 + 4 / block_size), rel=0.02)


def test_sparq_value_axes_engine(smollm_llm):
    """With value axes: each layer's are orthonormal principal axes of the calibration text's values, and the cache
    holds its values' coordinates; the tail they give brings the perplexity of real text nearer dense attention's
    than SparQ's mean value does; stats count their bytes; they take their share of the cache; `"recent"` reaches
    the kernels."""
    text = real_text(smollm_llm, 200)
    cfg = {**SPARQ, "basis": "none", "prompt": True}  # (the values' axes alone are calibrated)
    engine = engine_from(smollm_llm, sparse_attention={**cfg, "value_axes": 4})
    caches = engine.runner.kv_caches
    assert all(c.v_t.shape[1:] == (3, 64, 4) and c.sparq_value_axes.shape == (3, 64, 4) for c in caches)
    assert all((c.sparq_value_axes.transpose(1, 2) @ c.sparq_value_axes - torch.eye(4)).abs().max() < 1e-5
               for c in caches)
    assert rel_err(caches[0].sparq_value_axes, caches[1].sparq_value_axes) > 0.1
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def nll(e):  # over the tokens past the first 64 (SparQ chooses 24 keys of each token's context)
        lps = [next(iter(p.values())).logprob for p in run(e, [text], [scored])[0].prompt_logprobs[1:]]
        return -sum(lps[64:]) / len(lps[64:])

    without = engine_from(smollm_llm, sparse_attention=cfg)
    dense, tail, mean = nll(engine_from(smollm_llm)), nll(engine), nll(without)
    assert abs(tail - dense) < 0.7 * abs(mean - dense), (dense, tail, mean)
    got, was = engine.stats(), without.stats()
    assert got["sparse_attention_keys_fraction"] == was["sparse_attention_keys_fraction"]
    # (4 one-byte coordinates of every key and again of every chosen one, against 2 * 64 float32 values)
    assert got["sparse_attention_bytes_fraction"] - was["sparse_attention_bytes_fraction"] == pytest.approx(
        4 / 512 * (1 + got["sparse_attention_keys_fraction"]))
    plain = engine_from(smollm_llm, cpu_kv_cache_gb=0.25).stats()["kv_cache_capacity_tokens"]
    with_axes = engine_from(smollm_llm, cpu_kv_cache_gb=0.25, sparse_attention={**cfg, "value_axes": 4})
    # (as test_sparq_engine's, and 4 one-byte coordinates a token and head: 4 / 64 a value)
    assert with_axes.stats()["kv_cache_capacity_tokens"] / plain == pytest.approx(8 / (9 + 4 / 64 + 4 / 64),
                                                                                  rel=0.02)
    # the last 8 keys always among the 24 chosen: other keys, the same bytes
    recent = engine_from(smollm_llm, sparse_attention={**cfg, "value_axes": 4, "recent": 8})
    assert abs(nll(recent) - tail) > 1e-4
    assert recent.stats()["sparse_attention_bytes_fraction"] == got["sparse_attention_bytes_fraction"]


def test_sparq_4bit_key_copy_engine(smollm_llm):
    """`"key_bits": 4`: the cache keeps the key copy two keys a byte with a scale per key; SparQ reads it (other
    scores than the e4m3 copy's, near them); stats count r / 2 + 1 bytes of every key; the copy takes its share of
    the cache."""
    text = real_text(smollm_llm, 200)
    cfg = {**SPARQ, "basis": "none", "prompt": True}
    engine = engine_from(smollm_llm, sparse_attention={**cfg, "key_bits": 4})
    cache = engine.runner.kv_caches[0]
    blocks = cache.k.shape[0]
    assert cache.k_t.shape == (blocks, 3, 64, 32) and cache.k_t.dtype == torch.uint8
    assert cache.k_t_scale.shape == (blocks, 3, 64) and cache.sparq_key_bits == 4
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def logprobs(e):
        return torch.tensor([next(iter(p.values())).logprob for p in run(e, [text], [scored])[0].prompt_logprobs[1:]])

    e4m3 = engine_from(smollm_llm, sparse_attention=cfg)
    four, eight, dense = logprobs(engine), logprobs(e4m3), logprobs(engine_from(smollm_llm))
    assert 1e-4 < (four - eight).abs().mean() < (eight - dense).abs().mean()
    got, was = engine.stats(), e4m3.stats()
    # (16 components: 8 bytes and the scale instead of 16, against 2 * 64 float32 values)
    assert was["sparse_attention_bytes_fraction"] - got["sparse_attention_bytes_fraction"] == pytest.approx(7 / 512)
    plain = engine_from(smollm_llm, cpu_kv_cache_gb=0.25).stats()["kv_cache_capacity_tokens"]
    small = engine_from(smollm_llm, cpu_kv_cache_gb=0.25, sparse_attention={**cfg, "key_bits": 4})
    # (float32 K + V: 8 bytes a value; K again in 4 bits: 1 / 2; a scale per key: 1 / 64; the sums: 4 / 64)
    assert small.stats()["kv_cache_capacity_tokens"] / plain == pytest.approx(8 / (8.5 + 1 / 64 + 4 / 64), rel=0.02)


def test_sparq_with_prefix_caching_copy_on_write_and_preemption(smollm_llm):
    """With `prompt` (every token through SparQ, so a preempted sequence's recomputation gives what its decode
    gave), requests batched with prefix hits, forked samples and preemption get the tokens they get alone (the
    paper's basis: these mechanics copy k_t as bytes, whatever basis it is in, and each engine would calibrate)."""
    cfg = {**SPARQ, "prompt": True, "basis": "none"}
    shared = real_text(smollm_llm, 48)
    prompts = [shared + real_text(smollm_llm, 2, start=100 * i) for i in range(3)] + [real_text(smollm_llm, 30, 9000)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3 + \
        [SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12)]
    batched = engine_from(smollm_llm, sparse_attention=cfg, num_gpu_blocks=10, max_num_batched_tokens=32, block_size=16)
    together = tokens(batched, prompts, params)
    assert batched.stats()["num_preemptions"] > 0 and batched.stats()["prefix_cache_hits"] > 0
    alone = [tokens(engine_from(smollm_llm, sparse_attention=cfg, enable_prefix_caching=False), [p], [sp])[0]
             for p, sp in zip(prompts, params)]
    assert together == alone


@pytest.mark.parametrize("setting,other,names", [
    ({"method": "sparq", "r": 8}, {}, "k must be an integer"),
    ({"method": "sparq", "r": 0, "k": 8}, {}, "r must be an integer >= 1"),
    ({"method": "sparq", "r": 65, "k": 8}, {}, "r must be at most the head dimension (64)"),
    ({"method": "dense", "r": 8, "k": 8}, {}, "method must be one of"),
    ({"method": "sparq", "r": 8, "k": 8, "top_k": 3}, {}, "top_k is not a known key"),
    ({"method": "sparq", "r": 8, "k": 8, "local": 3}, {}, "local does not apply to method sparq"),
    ({"method": "block", "local": 0}, {}, "local must be an integer >= 1"),
    ({"method": "block", "block": 96}, {}, "block must be a multiple of 64"),
    ({"method": "block", "stride": 1}, {}, "stride 1 would make every block a line"),
    ({"method": "block", "block": 64}, {"block_size": 128}, "block must be a multiple of the cache's block_size"),
    ({"method": "block", "k": 8}, {}, "k does not apply to method block"),
    ({"method": "block", "density": 1.5}, {}, "density must be a number in"),
    ({"method": "block", "density": "1/4"}, {}, "density must be a number in"),
    ({"method": "block", "density": 0.25, "sample": 0}, {}, "sample must be an integer >= 1"),
    ({"method": "block", "density": 0.25, "stride": 4}, {}, "density and stride do not go together"),
    ({"method": "block", "density": 0.25, "sample_heads": "two"}, {}, "sample_heads must be one of all, one"),
    ({"method": "block", "sample": 4}, {}, "sample applies with density only"),
    ({"method": "block"}, {"deterministic": True}, "not served with deterministic"),
    ({"method": "sparq", "r": 8, "k": 8, "prompt": "yes"}, {}, "prompt must be true or false"),
    ({"method": "sparq", "r": 8, "k": 8, "basis": "svd"}, {}, "basis must be one of pca, none"),
    ({"method": "sparq", "r": 8, "k": 8, "value_axes": -1}, {}, "value_axes must be an integer >= 0"),
    ({"method": "sparq", "r": 8, "k": 8, "value_axes": 17}, {}, "value_axes must be at most 16"),
    ({"method": "sparq", "r": 8, "k": 8, "recent": -1}, {}, "recent must be an integer >= 0"),
    ({"method": "sparq", "r": 8, "k": 8, "recent": 9}, {}, "recent must be at most k (8)"),
    ({"method": "sparq", "r": 8, "k": 8, "key_bits": 2}, {}, "key_bits must be 8 (e4m3) or 4"),
    ({"method": "sparq", "r": 8, "k": 8, "key_bits": True}, {}, "key_bits must be an integer >= 1"),
    ({"method": "sparq", "r": 8, "k": 8, "key_bits": 4}, {"block_size": 16}, "key_bits 4 is served at block_size 64"),
    ("sparq", {}, "sparse_attention must be dict or None"),
    (SPARQ, {"kv_cache_dtype": "int8"}, "not served with kv_cache_dtype"),
    (SPARQ, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "not served with speculative"),
    ({**SPARQ, "prompt": True}, {"kernels": "triton"}, "prompt=true runs on the CPU and PyTorch kernels only"),
])
def test_sparse_attention_settings_fail_clearly(smollm_llm, setting, other, names):
    with pytest.raises(ParameterError, match=names.replace("(", r"\(").replace(")", r"\)")):
        engine_from(smollm_llm, sparse_attention=setting, **other)


PATTERNS = [BlockSparsePattern(64, 1, 2, 0), BlockSparsePattern(64, 2, 1, 3), BlockSparsePattern(128, 0, 2, 2)]


def test_block_sparse_pattern_counts_keys():
    """keys_seen (the stats' count) agrees with the mask, which is causal and never leaves a query without keys."""
    pos = torch.arange(3000)
    for pattern in PATTERNS + [BlockSparsePattern(64, 5, 3, 4)]:
        mask = pattern.visible(pos, pos)
        assert torch.equal(mask.sum(1), pattern.keys_seen(pos))
        assert not bool(mask.triu(1).any()) and bool(mask.diagonal().all())


def test_split_lists_exactly_the_keys_the_pattern_shows():
    """Random patterns, page sizes and chunks: mapping each split sequence's keys back through its block table to
    positions in the real cache, its queries (causal within it) see exactly what `pattern.visible` shows each of
    them; the queries keep their order; a one-token chunk stays whole."""
    rng = random.Random(0)
    for _ in range(100):
        pattern = BlockSparsePattern(64 * rng.randint(1, 2), rng.randint(0, 3), rng.randint(1, 4), rng.choice([0, 2, 3, 5]))
        page, n = rng.choice([8, 16, 64]), rng.randint(1, 400)
        q = rng.randint(1, n)
        table = rng.sample(range(1000), -(-n // page))
        split = pattern.split([q], [n], [table], page)
        q_lens, k_lens, tables = split.q_lens, split.k_lens, split.tables
        pos = torch.arange(n)
        want = pattern.visible(pos[n - q:], pos) if q > 1 else pos[None, :] <= n - 1
        got = torch.zeros(q, n, dtype=torch.bool)
        row = 0
        for q_len, k_len, pages in zip(q_lens, k_lens, tables):
            real = torch.tensor([table.index(pages[j // page]) * page + j % page for j in range(k_len)])
            for i in range(q_len):
                got[row + i, real[:k_len - q_len + i + 1]] = True
            row += q_len
        assert row == q and torch.equal(got, want), (pattern, page, n, q)
        assert (len(q_lens) == 1) == (q == 1 or (n - q) // pattern.block == (n - 1) // pattern.block)


def masked_by_pattern(pattern, q, cache, table, cu_q, seq_lens):
    """Attention of each sequence's queries (the last of its keys) over its keys in a paged cache, each query seeing
    what `pattern.visible` says (a sequence decoding one token: every key), float64, written plainly."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    page = cache.block_size
    for i, n in enumerate(seq_lens.tolist()):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        keys, values = (x.flatten(0, 1)[:n] for x in ref.read_pages(cache, table[i, :-(-n // page)], torch.float64))
        pos = torch.arange(n, device=q.device)
        seen = pos[None, :] <= pos[n - (rows.stop - rows.start):, None]
        if rows.stop - rows.start > 1:
            seen = seen & pattern.visible(pos[n - (rows.stop - rows.start):], pos)
        group = q.shape[1] // keys.shape[1]
        s = torch.einsum("qhd,khd->hqk", q[rows].double(), keys.repeat_interleave(group, 1)) * q.shape[-1] ** -0.5
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
        out[rows] = torch.einsum("hqk,khd->qhd", p, values.repeat_interleave(group, 1))
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("lens_k,lens_q,page,hq,hkv,dim", [
    ([700, 300, 90], [700, 1, 37], 16, 8, 2, 64),  # a whole prompt, a decode (dense), a chunk after a prefix
    ([520, 260], [200, 3], 32, 9, 3, 128),  # chunks; three queries take the copy-engine tiles on Hopper
    ([333, 64], [333, 64], 64, 4, 4, 64),  # pages as large as the pattern's blocks
])
def test_block_sparse_prefill_matches_reference(pattern, lens_k, lens_q, page, hq, hkv, dim):
    """The batch split by the pattern (each block of a chunk's queries a sequence over the pages it sees), through
    the Triton paged prefill, against float64 attention masked by the pattern, as accurate as the dense kernel is
    against dense attention; a sequence decoding one token stays dense. The CPU kernels give the same."""
    torch.manual_seed(sum(lens_k) + pattern.local)
    k, v, table, seq_lens, cu_q = paged_case(lens_k, lens_q, page, hkv, dim, torch.bfloat16)
    q = torch.randn(int(cu_q[-1]), hq, dim, device=DEVICE, dtype=torch.bfloat16)
    cache = KVCache(k, v)
    out = torch.full_like(q, float("nan"))
    tables = [row[:-(-n // page)].tolist() for row, n in zip(table, seq_lens.tolist())]
    split = pattern.split((cu_q[1:] - cu_q[:-1]).tolist(), seq_lens.tolist(), tables, page)
    view = block_sparse_view(pattern, split, torch.device(DEVICE))
    tri.paged_attention(q, cache, view.block_table, view.cu_seqlens_q, view.seq_lens_k, view.max_seqlen_q, out=out)
    double = KVCache(k.double(), v.double())
    want = masked_by_pattern(pattern, q, double, table, cu_q, seq_lens)
    dense = ref.paged_attention(q.double(), double, table, cu_q, seq_lens, max(lens_q))
    assert rel_err(masked_by_pattern(BlockSparsePattern(64, 0, 10**6, 0), q, double, table, cu_q, seq_lens),
                   dense) < 1e-12  # (the oracle itself, with a pattern that hides nothing)
    cpu_view = block_sparse_view(pattern, split, torch.device("cpu"))
    cpu_out = cpu_kernels.paged_attention(q.cpu().float(), KVCache(k.cpu().float(), v.cpu().float()),
                                          cpu_view.block_table, cpu_view.cu_seqlens_q, cpu_view.seq_lens_k,
                                          cpu_view.max_seqlen_q)
    assert rel_err(cpu_out.double(), want.cpu()) < 1e-5
    dense_kernel = tri.paged_attention(q, cache, table, cu_q, seq_lens, max(lens_q))
    assert rel_err(out, want) < TOL[torch.bfloat16]
    assert rel_err(out, want) < 1.5 * rel_err(dense_kernel, dense)  # (as accurate as the dense kernel)
    assert rel_err(want, dense) > 0.05  # (the pattern hides keys)
    decode = int(cu_q[1])  # the decoding sequence's row sees every key
    if lens_q[1] == 1:
        assert rel_err(out[decode], dense[decode]) < 1e-2


CHOOSING = [BlockSparsePattern(64, 1, 2, 0, 0.5, 8), BlockSparsePattern(64, 0, 1, 0, 0.4, 16),
            BlockSparsePattern(128, 1, 1, 0, 0.75, 8), BlockSparsePattern(64, 1, 2, 0, 0.5, 4, one_head=True)]


def test_split_with_density_keeps_what_positions_say():
    """A pattern with density: each split sequence's keys are its forced blocks plus a gap for the chosen ones, as
    many as `kept_blocks` says (a share of the causal blocks, rounded up, never fewer than the forced ones);
    `keys_seen` counts the same; the choices name the right rows and candidates."""
    rng = random.Random(1)
    for _ in range(60):
        pattern = BlockSparsePattern(64 * rng.randint(1, 2), rng.randint(0, 2), rng.randint(1, 3), 0,
                                     rng.choice([0.1, 0.25, 0.5, 1.0]), rng.choice([1, 8, 64]))
        page, lens = rng.choice([16, 64]), [rng.randint(1, 900) for _ in range(3)]
        q_lens = [rng.randint(1, n) for n in lens]
        tables = [rng.sample(range(5000), -(-n // page)) for n in lens]
        split = pattern.split(q_lens, lens, tables, page)
        assert sum(split.q_lens) == sum(q_lens)
        rows = iter(range(len(split.q_lens)))
        choices = {c[0]: c for c in split.choices}
        first_row = 0
        for seq, (q, n) in enumerate(zip(q_lens, lens)):
            if q == 1:
                assert split.k_lens[next(rows)] == n
                first_row += 1
                continue
            for qb in range((n - q) // pattern.block, -(-n // pattern.block)):
                r = next(rows)
                q0, last = max(n - q, qb * pattern.block), min(n, (qb + 1) * pattern.block)
                sinks, candidates, chosen = pattern.kept_blocks(qb)
                assert sinks + candidates + min(pattern.local, qb + 1) == qb + 1
                kept = sinks + chosen + min(pattern.local, qb + 1)
                assert kept == max(-(-round(pattern.density * 1000 * (qb + 1)) // 1000), kept - chosen)
                assert split.k_lens[r] == (kept - 1) * pattern.block + last - qb * pattern.block
                assert int(pattern.keys_seen(torch.tensor([last - 1]))) == split.k_lens[r]
                if chosen:
                    assert choices[r] == (r, seq, first_row + q0 - (n - q), last - q0, q0, sinks, candidates, chosen)
                else:
                    assert r not in choices
            first_row += q


def mass_by_hand(q, keys, q_pos, pattern, first, candidates):
    """Float64: the attention of a query block's queries q [n, Hq, D] at positions q_pos (every `sample`-th from
    the last) over keys [L, Hkv, D] (causal), summed over the sampled rows and each KV head's group (one_head: the
    j-th sampled query in the group's head j % group alone), per candidate block: [Hkv, candidates]."""
    hkv = keys.shape[1]
    group = q.shape[1] // hkv
    mass = torch.zeros(hkv, keys.shape[0], dtype=torch.float64)
    for j, row in enumerate(range(q.shape[0] - 1, -1, -pattern.sample)):
        for head in range(q.shape[1]):
            if pattern.one_head and head % group != j % group:
                continue
            s = keys[:, head // group].double() @ q[row, head].double() * q.shape[-1] ** -0.5
            mass[head // group] += torch.softmax(s.masked_fill(torch.arange(keys.shape[0]) > q_pos[row],
                                                               float("-inf")), -1)
    block = pattern.block
    return torch.stack([mass[:, (first + b) * block:(first + b + 1) * block].sum(-1) for b in range(candidates)], -1)


@triton.jit
def _first_digits_kernel(Values, Hist, ChunkHist, ChunkAbove, n, LEVELS: tl.constexpr, KEY_BITS: tl.constexpr,
                         DROP_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """A row's first digits, counted as a kernel that writes the values counts them (SparQ's aggregation)."""
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(Values + row * n + i, mask=i < n, other=-1.0)
    topk.count_first_digits(Hist, ChunkHist, ChunkAbove, row, tl.program_id(1), tl.num_programs(1), values, i < n,
                            LEVELS, KEY_BITS, DROP_BITS)


@pytest.mark.parametrize("drop_bits", [0, 10])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(1, 1), (700, 0), (3000, 37), (2049, 2049), (300, 500)])
def test_top_k_positions(dtype, n, k, chunked, drop_bits, monkeypatch):
    """Both Triton selects (a row in registers; chunked, here in chunks of 256 (128 on a GPU), a radix select over
    histograms, also with its first digits counted by another kernel) against the reference: the same positions,
    first ones taken among equal values, in position order, the slots past k filled; and the reference's values are
    torch.topk's. Rows hold values past a sequence's end (-1, -inf), ties, zeros, values from 0 to 3 (the first
    digit of a float32 changes at 2), infinity beside 40,000 (whose fp16 exponent is the largest finite one), and a
    row below zero throughout; k per row too. With drop_bits the values rank by their bits less the lowest five or
    ten (SparQ's fp16 sums drop ten, all but the exponent, one radix digit): many more ties."""
    if chunked:  # (on a GPU these few rows take the short chunks)
        monkeypatch.setattr(topk, "MAX_ROW", 0)
        monkeypatch.setattr(topk, "CHUNK", 256)
        monkeypatch.setattr(topk, "SHORT_CHUNK", 128)
    torch.manual_seed(n + k)
    values = torch.rand(3, 2, n, device=DEVICE).to(dtype)
    values[0, 0, n // 2:] = -1.0
    values[0, 1, :n // 3] = 0.25
    values[1, 0] = float("-inf")
    values[1, 1, ::7] = 0.0
    values[2, 0] *= 3
    values[2, 1, 3:6] = torch.tensor([40000.0, 1.0, float("inf")])[:max(n - 3, 0)]
    per_row = torch.randint(0, k + 2, (3, 2), device=DEVICE)
    per_row[2, 1] = 1  # infinity, or the 40,000 before it where they tie
    for ks in (k, per_row):
        want = ref.top_k_positions(values, ks, k + 3, -7, drop_bits=drop_bits)
        assert torch.equal(tri.top_k_positions(values, ks, k + 3, -7, drop_bits=drop_bits), want)
        if chunked:
            digits = topk.digit_counts(values, 128, drop_bits=drop_bits)
            digits.chunk_hist.fill_(-999)  # (poisoned: written whole where the first digit is the only one)
            digits.chunk_above.fill_(-999)
            _first_digits_kernel[(6, triton.cdiv(n, 128))](values, digits.hist, digits.chunk_hist, digits.chunk_above,
                                                           n, LEVELS=digits.levels,
                                                           KEY_BITS=8 * values.element_size(), DROP_BITS=drop_bits,
                                                           BLOCK=128)
            assert torch.equal(tri.top_k_positions(values, ks, k + 3, -7, first_digits=digits, drop_bits=drop_bits),
                               want)
        for row, kept in zip(values.view(6, n), want.view(6, -1)):
            taken = kept[kept >= 0].long()
            assert len(taken) == min(int(ks) if isinstance(ks, int) else len(taken), n)
            if drop_bits == 0:
                assert torch.equal(row[taken].float().sort().values, row.float().topk(len(taken)).values.sort().values)
            elif len(taken) and row[taken].min() >= 0:  # dropped bits tell apart no less than 2 ** (5 - mantissa)
                least = row[taken].float().min()
                rel = 2.0 ** (drop_bits - (10 if dtype == torch.float16 else 23))
                finite = row.float().nan_to_num(posinf=0.0)  # (infinity may tie with the largest exponent)
                assert (finite > least * (1 + 2 * rel)).sum() < len(taken)
        if isinstance(ks, torch.Tensor):
            assert torch.equal((want >= 0).sum(-1), ks.clamp(max=n))
        narrow = ref.top_k_positions(values, ks, k // 2 + 1, -7, drop_bits=drop_bits)  # k over width: the largest
        assert torch.equal(tri.top_k_positions(values, ks, k // 2 + 1, -7, drop_bits=drop_bits), narrow)
        clamped = torch.as_tensor(ks, device=DEVICE).clamp(max=k // 2 + 1)  # (an int k: a tensor on DEVICE too)
        assert torch.equal(narrow, ref.top_k_positions(values, clamped, k // 2 + 1, -7, drop_bits=drop_bits))


@pytest.mark.parametrize("pattern", CHOOSING)
@pytest.mark.parametrize("lens_k,lens_q,page,hq,hkv,dim", [
    ([700, 300, 90], [700, 1, 37], 16, 8, 2, 64),  # a whole prompt, a decode (dense), a chunk after a prefix
    ([520, 600], [200, 3], 32, 9, 3, 128),  # chunks; three queries take the copy-engine tiles on Hopper
    ([460], [460], 64, 4, 4, 64),  # pages as large as the pattern's blocks
])
def test_chosen_blocks_prefill_matches_reference(pattern, lens_k, lens_q, page, hq, hkv, dim):
    """Blocks chosen per KV head: `block_mass` (Triton, and the CPU's reference in float32) against the sampled
    queries' attention computed by hand in float64; the tables `choose_blocks` fills list, per KV head, the forced
    blocks and the candidates of highest mass; and attention through them (Triton, CPU) equals float64 attention
    masked per KV head by those blocks, as accurate as the dense kernel is."""
    torch.manual_seed(sum(lens_k) + pattern.local)
    k, v, table, seq_lens, cu_q = paged_case(lens_k, lens_q, page, hkv, dim, torch.bfloat16)
    q = torch.randn(int(cu_q[-1]), hq, dim, device=DEVICE, dtype=torch.bfloat16)
    cache, double = KVCache(k, v), KVCache(k.double(), v.double())
    tables = [row[:-(-n // page)].tolist() for row, n in zip(table, seq_lens.tolist())]
    split = pattern.split((cu_q[1:] - cu_q[:-1]).tolist(), seq_lens.tolist(), tables, page)
    view = block_sparse_view(pattern, split, torch.device(DEVICE))
    choice = view.block_choice
    assert choice is not None and choice.max_chosen >= 1
    by_hand = torch.full((hkv, len(split.choices), choice.max_candidates), float("-inf"), dtype=torch.float64)
    for r, (_, seq, q0, n_q, pos0, first, candidates, _) in enumerate(split.choices):
        keys = ref.read_pages(double, table[seq, :-(-(pos0 + n_q) // page)], torch.float64)[0].flatten(0, 1)
        by_hand[:, r, :candidates] = mass_by_hand(q[q0:q0 + n_q].cpu(), keys[:pos0 + n_q].cpu(),
                                                  torch.arange(pos0, pos0 + n_q), pattern, first, candidates)
    mass = tri.block_mass(q, cache, table, choice)
    assert torch.equal(tri.block_mass(q, cache, table, choice, scratch_bytes=1), mass)  # a launch per run
    finite = by_hand > float("-inf")
    assert torch.equal(mass.cpu() > float("-inf"), finite)
    assert rel_err(mass.cpu()[finite], by_hand[finite]) < 2e-2
    cpu_q = q.cpu().float()
    cpu_cache = KVCache(k.cpu().float(), v.cpu().float())
    cpu_choice = dataclasses.replace(choice, rows=choice.rows.cpu(), runs=choice.runs.cpu())
    cpu_mass = cpu_kernels.block_mass(cpu_q, cpu_cache, table.cpu(), cpu_choice)
    assert rel_err(cpu_mass[finite], by_hand[finite]) < 1e-5

    for ops, qq, kv, tab, m, c, tol in ((tri, q, cache, table, mass, choice, None),
                                        (cpu_kernels, cpu_q, cpu_cache, table.cpu(), cpu_mass, cpu_choice, 1e-5)):
        rows = view.block_table.to(tab.device)
        per_head = choose_blocks(ops, qq, kv, tab, rows, c, None)
        assert per_head.shape == (len(split.q_lens), hkv, rows.shape[1] + 1)
        want_tables = [[list(t) for _ in range(hkv)] for t in split.tables]
        for r, (row, seq, _, _, _, first, _, chosen) in enumerate(split.choices):
            for h in range(hkv):
                best = sorted(m[h, r].topk(chosen).indices.tolist())
                per_block = pattern.block // page
                pages = [tables[seq][(first + b) * per_block + i] for b in best for i in range(per_block)]
                want_tables[row][h][first * per_block:(first + chosen) * per_block] = pages
        for r, t in enumerate(want_tables):
            for h in range(hkv):
                assert per_head[r, h, :len(t[h])].tolist() == t[h], (r, h)
        out = torch.full_like(qq, float("nan"))
        ops.paged_attention(qq, kv, per_head, view.cu_seqlens_q.to(tab.device), view.seq_lens_k.to(tab.device),
                            view.max_seqlen_q, out=out)
        want = ref.paged_attention(qq.double(), KVCache(kv.k.double(), kv.v.double()), per_head,
                                   view.cu_seqlens_q.to(tab.device), view.seq_lens_k.to(tab.device),
                                   view.max_seqlen_q)
        if tol is None:  # (Triton: as accurate as its dense kernel against dense attention)
            dense = ref.paged_attention(q.double(), double, table, cu_q, seq_lens, max(lens_q))
            tol = 1.5 * rel_err(tri.paged_attention(q, cache, table, cu_q, seq_lens, max(lens_q)), dense)
        assert rel_err(out, want) < tol


def test_per_head_tables_attend_by_hand():
    """The float64 reference's reading of a table per KV head, written plainly: each KV head's queries over the
    keys of its own pages (here a random subset of the sequence's pages, per head)."""
    torch.manual_seed(5)
    hq, hkv, dim, page = 6, 3, 32, 16
    k, v, table, seq_lens, cu_q = paged_case([200], [40], page, hkv, dim, torch.float64)
    pages = [sorted(random.Random(h).sample(range(13), 8)) for h in range(hkv)]
    per_head = torch.tensor([[[int(table[0, p]) for p in ps] for ps in pages]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(40, hq, dim, dtype=torch.float64, device=DEVICE)
    lens = torch.tensor([8 * page], dtype=torch.int32, device=DEVICE)
    out = ref.paged_attention(q, KVCache(k, v), per_head, cu_q, lens, 40)
    for h in range(hkv):
        keys = torch.cat([k[int(table[0, p]), :, h] for p in pages[h]])
        values = torch.cat([v[int(table[0, p]), :, h] for p in pages[h]])
        for g in range(hq // hkv):
            s = q[:, h * 2 + g] @ keys.T / dim ** 0.5
            pos = torch.arange(len(keys), device=DEVICE)
            s = s.masked_fill(pos > pos[-40:, None], float("-inf"))
            assert rel_err(out[:, h * 2 + g], torch.softmax(s, -1) @ values) < 1e-12


def test_block_sparse_engine(smollm_llm):
    """Block-sparse prefill in the engine: a window covering the prompt changes nothing; a narrow one changes
    the prompt's log-probs, the same whole or prefilled in chunks, and with a prefix hit; stats count the keys
    the pattern kept."""
    prompt = real_text(smollm_llm, 300)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)

    def logprobs(engine, prompts):
        return [[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in run(engine, prompts,
                                                                                              params)]

    dense = logprobs(engine_from(smollm_llm), [prompt])[0]
    wide = {"method": "block", "block": 64, "sink": 0, "local": 5}
    assert logprobs(engine_from(smollm_llm, sparse_attention=wide), [prompt])[0] == pytest.approx(dense, abs=1e-4)
    narrow = {"method": "block", "block": 64, "sink": 1, "local": 1, "stride": 2}
    engine = engine_from(smollm_llm, sparse_attention=narrow)
    whole = logprobs(engine, [prompt])[0]
    assert max(abs(a - b) for a, b in zip(whole, dense)) > 0.1
    stats = engine.stats()
    pattern = BlockSparsePattern(64, 1, 1, 2)
    positions = torch.arange(len(prompt))
    assert stats["sparse_attention_keys_fraction"] == pytest.approx(
        float(pattern.keys_seen(positions).sum() / (positions + 1).sum()))
    chunked = logprobs(engine_from(smollm_llm, sparse_attention=narrow, max_num_batched_tokens=96,
                                   enable_prefix_caching=False), [prompt])[0]
    assert chunked == pytest.approx(whole, abs=1e-4)
    gen = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)

    def generated(engine):
        out = run(engine, [prompt], gen)[0].outputs[0]
        return out.token_ids, [next(iter(e.values())).logprob for e in out.logprobs]

    engine = engine_from(smollm_llm, sparse_attention=narrow)
    run(engine, [prompt[:256] + real_text(smollm_llm, 20, start=20000)], gen)  # caches the first 16 blocks
    tokens, lps = generated(engine)
    assert engine.stats()["prefix_cache_hits"] >= 240
    want_tokens, want_lps = generated(engine_from(smollm_llm, sparse_attention=narrow, enable_prefix_caching=False))
    assert tokens == want_tokens and lps == pytest.approx(want_lps, abs=1e-4)


def test_chosen_blocks_engine(smollm_llm):
    """Key blocks chosen per KV head in the engine: the prompt's log-probs differ from dense attention's and from
    the forced blocks' alone; the same whole, in chunks of whole blocks, and after a prefix hit of whole blocks; a
    batch of two prompts gives each what it gives alone; stats count the kept keys."""
    prompt = real_text(smollm_llm, 300)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, ignore_eos=True)

    def logprobs(engine, prompts):
        return [[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in run(engine, prompts,
                                                                                              params)]

    chosen = {"method": "block", "block": 64, "sink": 1, "local": 1, "density": 0.5}
    engine = engine_from(smollm_llm, sparse_attention=chosen)
    whole = logprobs(engine, [prompt])[0]
    positions = torch.arange(len(prompt))
    pattern = BlockSparsePattern(64, 1, 1, 0, 0.5, 8)
    assert engine.stats()["sparse_attention_keys_fraction"] == pytest.approx(
        float(pattern.keys_seen(positions).sum() / (positions + 1).sum()))
    dense = logprobs(engine_from(smollm_llm), [prompt])[0]
    forced = logprobs(engine_from(smollm_llm, sparse_attention={**chosen, "density": 0.0}), [prompt])[0]
    assert max(abs(a - b) for a, b in zip(whole, dense)) > 0.05
    assert max(abs(a - b) for a, b in zip(whole, forced)) > 0.05
    chunked = logprobs(engine_from(smollm_llm, sparse_attention=chosen, max_num_batched_tokens=128,
                                   enable_prefix_caching=False), [prompt])[0]
    assert chunked == pytest.approx(whole, abs=1e-4)
    other = real_text(smollm_llm, 200, start=30000)
    both = logprobs(engine_from(smollm_llm, sparse_attention=chosen), [prompt, other])
    assert both[0] == pytest.approx(whole, abs=1e-4)
    assert both[1] == pytest.approx(logprobs(engine_from(smollm_llm, sparse_attention=chosen), [other])[0], abs=1e-4)
    gen = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)

    def generated(engine):  # (prompt log-probs would turn prefix caching off)
        out = run(engine, [prompt], gen)[0].outputs[0]
        return out.token_ids, [next(iter(e.values())).logprob for e in out.logprobs]

    engine = engine_from(smollm_llm, sparse_attention=chosen)
    run(engine, [prompt[:256] + other[:20]], gen)  # caches the prompt's first 4 blocks
    tokens, lps = generated(engine)
    assert engine.stats()["prefix_cache_hits"] >= 256
    want_tokens, want_lps = generated(engine_from(smollm_llm, sparse_attention=chosen, enable_prefix_caching=False))
    assert tokens == want_tokens and lps == pytest.approx(want_lps, abs=1e-4)


def test_passkey_retrieval_check(smollm_llm):
    """The quality bench's retrieval prompts: the key stated past the first 64-token block, about a quarter of the
    way in, the prompt about as long as asked; the default model, attending densely, answers with the key (so a
    sparse mode that misses it shows)."""
    from flashpage.bench.quality import passkey_prompt

    tok = smollm_llm.tokenizer
    keys = ["48213", "90517"]
    prompts = [passkey_prompt(tok, key, 400) for key in keys]
    for key, text in zip(keys, prompts):
        ids = tok.encode(text)
        where = len(tok.encode(text[:text.index(key)]))
        assert 350 <= len(ids) <= 450 and 64 < where < 0.4 * len(ids), (len(ids), where)
    outs = run(engine_from(smollm_llm), [tok.encode(p) for p in prompts], SamplingParams(temperature=0, max_tokens=8))
    assert [key in o.outputs[0].text for key, o in zip(keys, outs)] == [True, True], [o.outputs[0].text for o in outs]
