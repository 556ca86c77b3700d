"""Sampling on the device: penalties, then temperature, top-k / top-p / min-p and a seeded draw.

Each row is cut into chunks, one program per (row, chunk), so that one long row (a batch of one, 128k logits)
still spreads over the GPU. Launches, all without a host sync:
1. `_chunk_stats`: each chunk's maximum (and where it first occurs), and its sums of exp(x - max) at temperature 1
   and at T, in one read (online, as flash attention's softmax). Whoever needs the row's maximum or normalisers
   combines the chunks' (a few dozen numbers).
2. `_search_pass` x 10, only when some row uses top-k or top-p (rows that do not skip it). No sort: the kept set is
   {e >= threshold} with e = exp((x - max) / T) in (0, 1], and the top-k and top-p thresholds are found by
   bisection over the bit patterns of float32 e (monotone for non-negative floats): each pass counts (and for
   top-p sums) the e at 16 cut points of the filter's bracket and narrows it to one sixteenth; each reads the
   previous pass's per-chunk results and writes its own. A bracket holding at most one e is settled: later
   passes skip it. Reading the whole row every pass made the search cost eight passes over the logits, so once
   a bracket holds at most 2,048 e (after pass 0 or 1, as a rule) the next pass copies the logits inside it aside
   (and tallies those above it) instead, and later passes read only the copies.
3. `_race`: per chunk, the exponential race: argmax over kept tokens of e_i / E_i with E_i ~ Exp(1) from Philox
   keyed by the row's seed and the token id (so a seeded row does not depend on its neighbours, nor on how it is
   cut into chunks). This samples the kept, renormalised distribution. A row verifying a draft token races over
   the residual max(p - q, 0) instead (after `_kept_mass`, per chunk, has summed the kept e that normalise p).
4. `_finish`: per row, the winning chunk (ties: lowest token id; temperature 0: the first maximum, as
   torch.argmax) and the chosen token's log-probability under softmax(logits); a draft token kept with
   probability min(1, p / q) replaces the winner.
A batch of greedy rows alone (`greedy`) takes launches 1 and 4 only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.device import sm_count

_ONE_BITS = tl.constexpr(0x3F800000)  # float32 1.0
_LOW_BITS = tl.constexpr(0x33800000)  # float32 2^-24
_GATHER = tl.constexpr(2048)  # a bracket of at most this many e is copied aside (per row, filter and chunk)
_CUTS = tl.constexpr(16)  # cut points per search pass (cut 0 is the current lower bound)
# pass 0, eight that count after it (16 ** 8 > 0x33800000: pass 0's widest bracket, [0, 2^-24)) and one that gathers
_SEARCH_PASSES = tl.constexpr(10)


@triton.jit
def _row_summary(Stats, row, S: tl.constexpr, inv_t):
    """From the chunks' stats: the row's maximum, its first position, and the normalisers at 1 and at T."""
    c = tl.arange(0, S)
    base = Stats + (row * S + c) * 4
    m = tl.load(base)
    best = tl.max(m, 0)
    first = tl.min(tl.where(m == best, tl.load(base + 1), 2**31 - 1), 0).to(tl.int32)
    raw_total = tl.sum(tl.load(base + 2) * tl.exp(m - best), 0)
    total = tl.sum(tl.load(base + 3) * tl.exp((m - best) * inv_t), 0)
    return best, first, raw_total, total


@triton.jit
def _chunk_stats(Logits, Temperature, Stats, stride_l, vocab, chunk, S: tl.constexpr, BLOCK: tl.constexpr,
                 GREEDY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    base = Logits + row * stride_l
    inv_t = 1.0
    if not GREEDY:  # (every row at temperature 0: no Temperature, and the sum at T is the one at 1)
        t = tl.load(Temperature + row)
        inv_t = 1.0 / tl.where(t == 0.0, 1.0, t)
    start, end = c * chunk, tl.minimum(c * chunk + chunk, vocab)
    offs = tl.arange(0, BLOCK)
    # One read, not two (the maximum, then the sums): each lane keeps its running maximum and its sums of
    # exp(x - that maximum), rescaled when it grows.
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_i = tl.zeros((BLOCK,), tl.int32)
    raw = tl.zeros((BLOCK,), tl.float32)
    scaled = tl.zeros((BLOCK,), tl.float32)
    for i in range(start, end, BLOCK):
        x = tl.load(base + i + offs, mask=i + offs < end, other=float("-inf")).to(tl.float32)
        take = x > lane_max
        # one exponential a sum: of the smaller of x and the lane's maximum against the larger (a new maximum
        # rescales the sum, which then gains exp(0) = 1); nothing to add for x = -inf (-inf - -inf is NaN)
        d = tl.where(x == float("-inf"), float("-inf"), tl.where(take, lane_max - x, x - lane_max))
        e = tl.exp(d)
        raw = tl.where(take, raw * e + 1.0, raw + e)
        if not GREEDY:
            e = tl.exp(d * inv_t)
            scaled = tl.where(take, scaled * e + 1.0, scaled + e)
        lane_i = tl.where(take, i + offs, lane_i)
        lane_max = tl.where(take, x, lane_max)
    m = tl.max(lane_max, 0)
    first = tl.min(tl.where(lane_max == m, lane_i, 2**31 - 1), 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty chunk (past the vocabulary) sums to 0, not NaN
    lane_ref = tl.where(lane_max == float("-inf"), 0.0, lane_max)
    raw_sum = tl.sum(raw * tl.exp(lane_ref - m), 0)
    out = Stats + (row * S + c) * 4
    tl.store(out, tl.where(first == 2**31 - 1, float("-inf"), m))
    tl.store(out + 1, first.to(tl.float32))  # exact: token ids < 2 ** 24
    tl.store(out + 2, raw_sum)
    tl.store(out + 3, raw_sum if GREEDY else tl.sum(scaled * tl.exp((lane_ref - m) * inv_t), 0))


@triton.jit
def _cut_points(lo, hi, it):
    """The pass's 16 cut points in [lo, hi), as float32 bit patterns. Pass 0 spaces cuts 1-15 evenly over the bits
    of [2^-24, 1] (e below 2^-24 share the lowest bracket), where thresholds lie: even over all of [0, 1] they
    would be 2^8 apart and leave brackets too full to gather. Later passes cut their bracket evenly."""
    cut = tl.arange(0, _CUTS)
    even = lo + ((hi - lo).to(tl.int64) * cut // _CUTS).to(tl.int32)
    first = tl.where(cut == 0, 0, _LOW_BITS + ((_ONE_BITS + 1 - _LOW_BITS) * (cut - 1).to(tl.int64) // (_CUTS - 1)))
    return tl.where(it == 0, first.to(tl.int32), even)


@triton.jit
def _narrow(lo, hi, n, count, passing, it):
    """One bracket after pass `it` - 1 counted, per cut c, count[c] = #{e >= cut c} (cut 0 is lo) and tested the
    cuts (`passing` holds for a prefix of them): lo moves to the last passing cut, hi to the next one, and n
    becomes the count between them."""
    cut = tl.arange(0, _CUTS)
    cuts = _cut_points(lo, hi, it - 1)
    last = tl.max(tl.where(passing, cut, 0), 0)
    at_hi = tl.where(it == 1, 0, tl.sum(tl.where(cut == 0, count, 0), 0) - n)  # #{e >= hi}: none above 1.0
    beyond = tl.where(last == _CUTS - 1, at_hi, tl.sum(tl.where(cut == last + 1, count, 0), 0))
    hi = tl.where(last == _CUTS - 1, hi, tl.sum(tl.where(cut == last + 1, cuts, 0), 0))
    return tl.sum(tl.where(cut == last, cuts, 0), 0), hi, tl.sum(tl.where(cut == last, count, 0), 0) - beyond


@triton.jit
def _bounds(Bounds, Counts, Mass, row, it, top_k, top_p, total, vocab, S: tl.constexpr):
    """The search state after pass `it` - 1, per filter: its bracket [lo, hi) of threshold bits, n, how many of the
    row's e fall in it, and `gathered`, the pass that copies the bracket's logits aside (-1: none yet). A bracket
    of at most one is settled: {e >= lo} is then exactly the kept set, and later passes leave it be (an unused
    filter starts settled at lo = 0). Every program derives the state alike from the previous pass's per-chunk
    results (a program of pass 0 starts it)."""
    cut = tl.arange(0, _CUTS)
    k_lo = tl.full((), 0, tl.int32)
    k_hi = tl.full((), _ONE_BITS + 1, tl.int32)
    k_n = tl.where(top_k < vocab, 2**30, 0).to(tl.int32)
    k_gathered = tl.full((), -1, tl.int32)
    p_lo = tl.full((), 0, tl.int32)
    p_hi = tl.full((), _ONE_BITS + 1, tl.int32)
    p_n = tl.where(top_p < 1.0, 2**30, 0).to(tl.int32)
    p_gathered = tl.full((), -1, tl.int32)
    if it > 0:
        prev = Bounds + (((it - 1) % 2) * tl.num_programs(0) + row) * 8
        k_lo, k_hi, k_n, k_gathered = tl.load(prev), tl.load(prev + 1), tl.load(prev + 2), tl.load(prev + 3)
        p_lo, p_hi, p_n, p_gathered = tl.load(prev + 4), tl.load(prev + 5), tl.load(prev + 6), tl.load(prev + 7)
        chunks = (((it - 1) % 2) * tl.num_programs(0) + row) * S + tl.arange(0, S)[:, None]
        if (k_n > 1) & (k_gathered != it - 1):  # counted in pass it - 1 (a gathering pass only copies)
            count = tl.sum(tl.load(Counts + chunks * 2 * _CUTS + cut[None, :]), 0)
            k_lo, k_hi, k_n = _narrow(k_lo, k_hi, k_n, count, count >= top_k, it)
            k_gathered = tl.where((k_gathered < 0) & (k_n <= _GATHER), it, k_gathered)
        if (p_n > 1) & (p_gathered != it - 1):
            count = tl.sum(tl.load(Counts + chunks * 2 * _CUTS + _CUTS + cut[None, :]), 0)
            mass = tl.sum(tl.load(Mass + chunks * _CUTS + cut[None, :]), 0)
            p_lo, p_hi, p_n = _narrow(p_lo, p_hi, p_n, count, mass >= top_p * total, it)
            p_gathered = tl.where((p_gathered < 0) & (p_n <= _GATHER), it, p_gathered)
    return k_lo, k_hi, k_n, k_gathered, p_lo, p_hi, p_n, p_gathered


@triton.jit
def _tally(Src, start, end, best, inv_t, cuts, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Per cut, how many e = exp((x - best) * inv_t) of Src[start:end] reach it (with MASS also their sum)."""
    offs = tl.arange(0, 4)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [4, BLOCK] a tile: more loads in flight
    count = tl.zeros((_CUTS, BLOCK), tl.int32)  # reduced once, not per tile
    mass = tl.zeros((_CUTS, BLOCK), tl.float32)
    for i in range(start, end, 4 * BLOCK):
        x = tl.load(Src + i + offs, mask=i + offs < end, other=float("-inf"))
        e = tl.exp((x.to(tl.float32) - best) * inv_t)[None, :, :]
        reach = e >= cuts[:, None, None]
        count += tl.sum(reach.to(tl.int32), 1)
        if MASS:
            mass += tl.sum(tl.where(reach, e, 0.0), 1)
    return tl.sum(count, 1), tl.sum(mass, 1)


@triton.jit
def _gather(Src, start, end, best, inv_t, lo, hi, Out, Filled, Above, AboveMass, BLOCK: tl.constexpr):
    """Copies the x of Src[start:end] whose e lies in [lo, hi) to Out, in order, and writes how many there are, and
    the count and the sum of the e at or above hi."""
    lo, hi = lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)
    offs = tl.arange(0, BLOCK)
    filled = tl.full((), 0, tl.int32)
    above = tl.zeros((BLOCK,), tl.int32)
    above_mass = tl.zeros((BLOCK,), tl.float32)
    for i in range(start, end, BLOCK):
        x = tl.load(Src + i + offs, mask=i + offs < end, other=float("-inf"))
        e = tl.exp((x.to(tl.float32) - best) * inv_t)
        inside = ((e >= lo) & (e < hi)).to(tl.int32)
        inside_count = tl.sum(inside, 0)
        if inside_count > 0:  # (most tiles hold none: no scan for them)
            tl.store(Out + filled + tl.cumsum(inside, 0) - 1, x, mask=inside != 0)
            filled += inside_count
        above += (e >= hi).to(tl.int32)
        above_mass += tl.where(e >= hi, e, 0.0)
    tl.store(Filled, filled)
    tl.store(Above, tl.sum(above, 0))
    tl.store(AboveMass, tl.sum(above_mass, 0))


@triton.jit
def _search_one(Logits, Gathered, Filled, Above, AboveMass, Counts, Mass, row, c, it, lo, hi, n, gathered, best, inv_t,
                stride_l, vocab, chunk, WHICH: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr):
    """One filter's share of a search pass in chunk c: per cut, how many e of the chunk reach it (and, for top-p,
    their sum). Until its bracket is gathered it reads the chunk's logits. The pass that gathers (the first whose
    bracket holds at most _GATHER) only copies the chunk's logits inside the bracket to its slot of Gathered, in
    order, and tallies the e above it (counting too made its loop as slow as two); later passes count over those
    copies alone and add the tally."""
    if n > 1:
        slot = (WHICH * tl.num_programs(0) + row) * S + c
        src = Logits + row * stride_l
        start, end = c * chunk, tl.minimum(c * chunk + chunk, vocab)
        if gathered == it:
            _gather(src, start, end, best, inv_t, lo, hi, Gathered + slot * _GATHER, Filled + slot, Above + slot,
                    AboveMass + slot, 4 * BLOCK)
        else:
            if gathered >= 0:
                src = Gathered + slot * _GATHER
                start, end = start * 0, tl.load(Filled + slot)
            cuts = _cut_points(lo, hi, it).to(tl.float32, bitcast=True)
            count, mass = _tally(src, start, end, best, inv_t, cuts, WHICH == 1, BLOCK)
            if gathered >= 0:
                count += tl.load(Above + slot)
                mass += tl.load(AboveMass + slot)
            cut = tl.arange(0, _CUTS)
            out = ((it % 2) * tl.num_programs(0) + row) * S + c
            tl.store(Counts + out * 2 * _CUTS + WHICH * _CUTS + cut, count)  # [top-k's, top-p's] per chunk
            if WHICH == 1:
                tl.store(Mass + out * _CUTS + cut, mass)


@triton.jit
def _search_pass(Logits, Temperature, TopK, TopP, Stats, Bounds, Counts, Mass, Gathered, Filled, Above, AboveMass,
                 stride_l, vocab, chunk, it, S: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(Temperature + row)
    top_k = tl.load(TopK + row)
    top_p = tl.load(TopP + row)
    if (t != 0.0) & ((top_k < vocab) | (top_p < 1.0)):
        inv_t = 1.0 / t
        best, _, _, total = _row_summary(Stats, row, S, inv_t)
        k_lo, k_hi, k_n, k_gathered, p_lo, p_hi, p_n, p_gathered = _bounds(Bounds, Counts, Mass, row, it, top_k, top_p,
                                                                           total, vocab, S)
        if c == 0:  # for the next pass (the state after pass it - 1 is still being read: two slots)
            out = Bounds + ((it % 2) * tl.num_programs(0) + row) * 8
            tl.store(out, k_lo)
            tl.store(out + 1, k_hi)
            tl.store(out + 2, k_n)
            tl.store(out + 3, k_gathered)
            tl.store(out + 4, p_lo)
            tl.store(out + 5, p_hi)
            tl.store(out + 6, p_n)
            tl.store(out + 7, p_gathered)
        _search_one(Logits, Gathered, Filled, Above, AboveMass, Counts, Mass, row, c, it, k_lo, k_hi, k_n, k_gathered,
                    best, inv_t, stride_l, vocab, chunk, 0, S, BLOCK)
        _search_one(Logits, Gathered, Filled, Above, AboveMass, Counts, Mass, row, c, it, p_lo, p_hi, p_n, p_gathered,
                    best, inv_t, stride_l, vocab, chunk, 1, S, BLOCK)


@triton.jit
def _threshold(Temperature, TopK, TopP, MinP, Stats, Bounds, Counts, Mass, row, vocab, SEARCHED: tl.constexpr,
               S: tl.constexpr):
    """The kept set of a sampled row is {e >= threshold}, e = exp((x - max) / T): min-p, top-k and top-p combined.
    Returns (max logit, 1 / T, threshold)."""
    inv_t = 1.0 / tl.load(Temperature + row)
    best, first, raw_total, total = _row_summary(Stats, row, S, inv_t)
    top_k = tl.load(TopK + row)
    top_p = tl.load(TopP + row)
    threshold = tl.load(MinP + row)  # min_p: e >= min_p * max e
    if SEARCHED:
        if (top_k < vocab) | (top_p < 1.0):
            # (names, not `_`: the GPU compiler gives a name one type across both sides of a runtime if)
            k_lo, k_hi, k_n, k_gathered, p_lo, p_hi, p_n, p_gathered = _bounds(Bounds, Counts, Mass, row,
                                                                               _SEARCH_PASSES, top_k, top_p, total,
                                                                               vocab, S)
            threshold = tl.maximum(threshold, tl.maximum(k_lo.to(tl.float32, bitcast=True),
                                                         p_lo.to(tl.float32, bitcast=True)))
    return best, inv_t, tl.minimum(threshold, 1.0)  # the most likely token always survives


@triton.jit
def _kept_mass(Logits, Temperature, TopK, TopP, MinP, Stats, Bounds, Counts, Mass, DraftTokens, Kept, stride_l, vocab,
               chunk, SEARCHED: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr):
    """Per chunk, the kept tokens' sum of e: with it a verified row knows its target probabilities p = e / sum."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if (tl.load(Temperature + row) != 0.0) & (tl.load(DraftTokens + row) >= 0):
        best, inv_t, threshold = _threshold(Temperature, TopK, TopP, MinP, Stats, Bounds, Counts, Mass, row, vocab,
                                            SEARCHED, S)
        start, end = c * chunk, tl.minimum(c * chunk + chunk, vocab)
        offs = tl.arange(0, BLOCK)
        kept = tl.zeros((BLOCK,), tl.float32)
        for i in range(start, end, BLOCK):
            x = tl.load(Logits + row * stride_l + i + offs, mask=i + offs < end, other=float("-inf")).to(tl.float32)
            e = tl.exp((x - best) * inv_t)
            kept += tl.where(e >= threshold, e, 0.0)
        tl.store(Kept + row * S + c, tl.sum(kept, 0))


@triton.jit
def _race(Logits, Temperature, TopK, TopP, MinP, Seed, Stats, Bounds, Counts, Mass, Winners, DraftTokens, DraftProbs,
          Kept, stride_l, stride_q, vocab, chunk, SEARCHED: tl.constexpr, DRAFT: tl.constexpr, S: tl.constexpr,
          BLOCK: tl.constexpr):
    """A row with a draft token races over the residual max(p - q, 0) (what it draws if the token is rejected);
    other rows over p."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(Temperature + row)
    if t != 0.0:
        best, inv_t, threshold = _threshold(Temperature, TopK, TopP, MinP, Stats, Bounds, Counts, Mass, row, vocab,
                                            SEARCHED, S)
        residual = False
        inv_kept = 1.0
        if DRAFT:
            residual = tl.load(DraftTokens + row) >= 0
            if residual:
                inv_kept = 1.0 / tl.sum(tl.load(Kept + row * S + tl.arange(0, S)), 0)
        seed = tl.load(Seed + row)
        start, end = c * chunk, tl.minimum(c * chunk + chunk, vocab)
        # Tiles of [BLOCK / 4, 4] tokens: one Philox call gives four uniforms, token i's being output i % 4 of
        # the call at offset i // 4 (a whole call per token made this kernel bound by its integer work).
        quad = tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
        lane_win = tl.full((BLOCK // 4, 4), float("-inf"), tl.float32)
        lane_i = tl.zeros((BLOCK // 4, 4), tl.int32) + start
        for i in range(start, end, BLOCK):
            idx = i + quad
            x = tl.load(Logits + row * stride_l + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
            z = (x - best) * inv_t
            kept = (tl.exp(z) >= threshold) & (idx < end)
            if residual:
                q = tl.load(DraftProbs + row * stride_q + idx, mask=idx < end, other=0.0)
                r = tl.where(kept, tl.exp(z) * inv_kept, 0.0) - q
                kept = r > 0.0
                z = tl.log(tl.where(kept, r, 1.0))
            u0, u1, u2, u3 = tl.rand4x(seed, i // 4 + tl.arange(0, BLOCK // 4))
            u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (BLOCK // 4, 4))  # [j, k]: u_k of call j
            score = z - tl.log(-tl.log(u))  # maximise log e_i - log E_i
            score = tl.where(kept, score, float("-inf"))
            take = score > lane_win
            lane_i = tl.where(take, idx, lane_i)
            lane_win = tl.where(take, score, lane_win)
        win = tl.max(tl.max(lane_win, 1), 0)
        first = tl.min(tl.min(tl.where(lane_win == win, lane_i, 2**31 - 1), 1), 0)
        tl.store(Winners + (row * S + c) * 2, win)
        tl.store(Winners + (row * S + c) * 2 + 1, first.to(tl.float32))


@triton.jit
def _finish(Logits, Temperature, TopK, TopP, MinP, Seed, Stats, Bounds, Counts, Mass, Winners, DraftTokens, DraftProbs,
            Kept, Out, OutLogprob, stride_l, stride_q, vocab, SEARCHED: tl.constexpr, DRAFT: tl.constexpr,
            S: tl.constexpr, GREEDY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best, token, raw_total, _ = _row_summary(Stats, row, S, 1.0)
    if not GREEDY and tl.load(Temperature + row) != 0.0:
        c = tl.arange(0, S)
        score = tl.load(Winners + (row * S + c) * 2)
        win = tl.max(score, 0)
        # no kept token won anywhere only if every draw underflowed: then the most likely token
        if win > float("-inf"):
            token = tl.min(tl.where(score == win, tl.load(Winners + (row * S + c) * 2 + 1), 2**31 - 1), 0).to(tl.int32)
        if DRAFT:
            draft = tl.load(DraftTokens + row).to(tl.int32)
            if draft >= 0:  # accept it with probability min(1, p / q) (the rejection sampler), else the residual's
                best_t, inv_t, threshold = _threshold(Temperature, TopK, TopP, MinP, Stats, Bounds, Counts, Mass, row,
                                                      vocab, SEARCHED, S)
                e = tl.exp((tl.load(Logits + row * stride_l + draft).to(tl.float32) - best) * inv_t)
                p = tl.where(e >= threshold, e, 0.0) / tl.sum(tl.load(Kept + row * S + c), 0)
                q = tl.load(DraftProbs + row * stride_q + draft)
                u = tl.rand(tl.load(Seed + row), vocab)  # an offset no token's race noise uses
                if (u * q < p) | (win == float("-inf")):  # (no residual left: p <= q everywhere, so p == q)
                    token = draft
    tl.store(Out + row, token.to(tl.int64))
    tl.store(OutLogprob + row, tl.load(Logits + row * stride_l + token).to(tl.float32) - best - tl.log(raw_total))


def _block(vocab: int) -> int:
    return max(min(triton.next_power_of_2(vocab), 1024), 4)  # (at least one Philox call's four tokens: `_race`)


def num_chunks(batch: int, vocab: int, device: torch.device, asked: int | None = None) -> int:
    """How many pieces `sample` cuts each of `batch` rows into (`asked`, or about two programs per SM over the
    batch; the interpreter cuts small batches in two, which tests the merging without multiplying its slow
    programs on large ones): a power of two, at most 64 and at most the row's tiles. Each count compiles its own
    kernels (it is a constexpr)."""
    if asked is None and device.type == "cuda":
        asked = triton.cdiv(2 * sm_count(device), batch)
    elif asked is None:
        asked = 2 if batch <= 16 else 1
    return min(triton.next_power_of_2(asked), 64, triton.next_power_of_2(triton.cdiv(vocab, _block(vocab))))


def chunk_classes(vocab: int, device: torch.device, max_rows: int) -> list[int]:
    """The smallest batch of each chunk count (`num_chunks`) up to `max_rows` rows: one batch per kernel variant,
    for a warm-up."""
    first: dict[int, int] = {}
    for batch in range(1, max_rows + 1):
        first.setdefault(num_chunks(batch, vocab, device), batch)
    return sorted(first.values())


def _outputs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token id [B] int64 and its log-probability [B] float32, to be written."""
    batch = logits.shape[0]
    return (torch.empty(batch, dtype=torch.int64, device=logits.device),
            torch.empty(batch, dtype=torch.float32, device=logits.device))


def _chunking(logits: torch.Tensor, chunks: int | None) -> tuple[int, int, int, torch.Tensor]:
    """How a non-empty batch's rows are cut: (BLOCK, chunk count, chunk width, the chunks' stats to be written)."""
    batch, vocab = logits.shape
    block = _block(vocab)
    chunks = num_chunks(batch, vocab, logits.device, chunks)
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    return block, chunks, chunk, torch.empty((batch, chunks, 4), dtype=torch.float32, device=logits.device)


def sample(logits, temperature, top_k, top_p, min_p, seeds, *, filtered: bool = True, draft_tokens=None,
           draft_probs=None, chunks: int | None = None):
    """logits [B, V] -> (token ids [B] int64, their log-probabilities under softmax(logits) [B] float32). Per row:
    temperature (0 = greedy), top_k (>= V: off), top_p, min_p (float32 tensors, top_k int32) and seeds (int64).
    filtered=False promises that no row uses top-k or top-p, which skips the threshold search. `chunks` (a power
    of two) fixes how many pieces each row is cut into, which otherwise follows the batch size.

    Speculative verification: where draft_tokens [B] int64 is >= 0, that token was drawn from the row of
    draft_probs [B, V] float32 (q); it is kept with probability min(1, p / q), p the row's distribution after
    temperature and filters, else the token is drawn from max(p - q, 0) renormalised (Leviathan et al.)."""
    batch, vocab = logits.shape
    dev = logits.device
    out, logprobs = _outputs(logits)
    if batch == 0:
        return out, logprobs
    block, chunks, chunk, stats = _chunking(logits, chunks)
    winners = torch.empty((batch, chunks, 2), dtype=torch.float32, device=dev)
    grid = (batch, chunks)
    _chunk_stats[grid](logits, temperature, stats, logits.stride(0), vocab, chunk, S=chunks, BLOCK=block, GREEDY=False)
    bounds = counts = mass = stats  # unread without a search
    if filtered:
        bounds = torch.empty((2, batch, 8), dtype=torch.int32, device=dev)
        counts = torch.empty((2, batch, chunks, 2, 16), dtype=torch.int32, device=dev)
        mass = torch.empty((2, batch, chunks, 16), dtype=torch.float32, device=dev)
        gathered = torch.empty((2, batch, chunks, _GATHER.value), dtype=logits.dtype, device=dev)  # [top-k's, top-p's]
        filled = torch.empty((2, batch, chunks), dtype=torch.int32, device=dev)
        above = torch.empty((2, batch, chunks), dtype=torch.int32, device=dev)
        above_mass = torch.empty((2, batch, chunks), dtype=torch.float32, device=dev)
        for it in range(_SEARCH_PASSES):
            _search_pass[grid](logits, temperature, top_k, top_p, stats, bounds, counts, mass, gathered, filled, above,
                               above_mass, logits.stride(0), vocab, chunk, it, S=chunks, BLOCK=256, num_warps=8)
    draft = draft_tokens is not None
    kept = torch.empty((batch, chunks), dtype=torch.float32, device=dev) if draft else stats
    if draft:
        _kept_mass[grid](logits, temperature, top_k, top_p, min_p, stats, bounds, counts, mass, draft_tokens, kept,
                         logits.stride(0), vocab, chunk, SEARCHED=filtered, S=chunks, BLOCK=block)
    else:
        draft_tokens = draft_probs = stats  # unread
    _race[grid](logits, temperature, top_k, top_p, min_p, seeds, stats, bounds, counts, mass, winners, draft_tokens,
                draft_probs, kept, logits.stride(0), draft_probs.stride(0), vocab, chunk, SEARCHED=filtered,
                DRAFT=draft, S=chunks, BLOCK=block)
    _finish[(batch,)](logits, temperature, top_k, top_p, min_p, seeds, stats, bounds, counts, mass, winners,
                      draft_tokens, draft_probs, kept, out, logprobs, logits.stride(0), draft_probs.stride(0), vocab,
                      SEARCHED=filtered, DRAFT=draft, S=chunks, GREEDY=False)
    return out, logprobs


def greedy(logits, *, chunks: int | None = None):
    """logits [B, V] -> (each row's first maximum [B] int64, as torch.argmax, and its log-probability under
    softmax(logits) [B] float32): `sample`'s first and last launches alone. One pass over the logits in chunks, so
    a batch of one spreads over the GPU (torch's argmax and logsumexp gave a 128k-logit row to one block each:
    about 90 us of a batch-1 decode step on an H200, docs/kernel-notes.md)."""
    batch, vocab = logits.shape
    out, logprobs = _outputs(logits)
    if batch == 0:
        return out, logprobs
    block, chunks, chunk, stats = _chunking(logits, chunks)
    _chunk_stats[(batch, chunks)](logits, stats, stats, logits.stride(0), vocab, chunk, S=chunks, BLOCK=block,
                                  GREEDY=True)
    # (Stats is the seventh pointer; stats also stands in for the twelve that a greedy finish does not read)
    _finish[(batch,)](logits, *[stats] * 13, out, logprobs, logits.stride(0), 0, vocab, SEARCHED=False, DRAFT=False,
                      S=chunks, GREEDY=True)
    return out, logprobs


@triton.jit
def _penalty_kernel(Logits, Rows, Tokens, Counts, Repetition, Presence, Frequency, stride_l, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    row = tl.load(Rows + i, mask=ok, other=0).to(tl.int64)
    ptr = Logits + row * stride_l + tl.load(Tokens + i, mask=ok, other=0)
    x = tl.load(ptr, mask=ok, other=0.0)
    count = tl.load(Counts + i, mask=ok, other=0).to(tl.float32)
    rep = tl.load(Repetition + row, mask=ok, other=1.0)
    x = tl.where(x > 0, x / rep, x * rep)
    x = x - tl.load(Presence + row, mask=ok, other=0.0) * (count > 0) - tl.load(Frequency + row, mask=ok, other=0.0) * count
    tl.store(ptr, x, mask=ok)


def apply_penalties(logits, rows, tokens, counts, repetition, presence, frequency) -> None:
    """In place. Entry i is token tokens[i] of row rows[i], seen in that row's prompt or output (each (row, token)
    once) and counts[i] times in its output: repetition penalty (transformers' rule) on every entry, presence and
    frequency from the output count. repetition/presence/frequency are per row, float32."""
    n = tokens.numel()
    if n:
        _penalty_kernel[(triton.cdiv(n, 1024),)](logits, rows, tokens, counts, repetition, presence, frequency,
                                                  logits.stride(0), n, BLOCK=1024)


@triton.jit
def _bitmask_kernel(Logits, Bitmask, stride_l, stride_b, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(Bitmask + row * stride_b + t // 32, mask=t < vocab, other=-1)
    banned = ((words >> (t % 32)) & 1) == 0
    tl.store(Logits + row * stride_l + t, tl.full((BLOCK,), float("-inf"), tl.float32), mask=banned & (t < vocab))


def apply_token_bitmask(logits, bitmask) -> None:
    """In place: -inf wherever bit (t % 32) of bitmask[row, t // 32] is 0 (a grammar's token mask; bitmask
    [B, ceil(V / 32)] int32, -1 = every token allowed)."""
    batch, vocab = logits.shape
    if batch:
        _bitmask_kernel[(batch, triton.cdiv(vocab, 4096))](logits, bitmask, logits.stride(0), bitmask.stride(0), vocab,
                                                           BLOCK=4096)
