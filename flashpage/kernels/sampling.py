"""Sampling on the device: penalties, then temperature, top-k / top-p / min-p and a seeded draw, one program per row.

No sort: the kept set is {p >= threshold}, where the top-k and top-p thresholds are found by bisection over the
bit patterns of float32 probabilities (monotone for non-negative floats), 15 cut points per pass, so eight
passes over the row find them exactly. The
draw is an exponential race, argmax over kept tokens of p_i / E_i with E_i ~ Exp(1), which samples from the
kept, renormalised distribution; E_i comes from Philox keyed by the row's seed and the token id, so a seeded row
does not depend on its neighbours. Temperature 0 is greedy (first maximum, as torch.argmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ONE_BITS = tl.constexpr(0x3F800000)  # float32 1.0


@triton.jit
def _sample_kernel(Logits, Out, OutLogprob, Temperature, TopK, TopP, MinP, Seed, stride_l, vocab, BLOCK: tl.constexpr,
                   SEARCH_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Logits + row * stride_l
    offs = tl.arange(0, BLOCK)
    # Pass 1: the maximum (and where it first occurs: the greedy token).
    # Per lane: its maximum and first position; one reduction at the end (ties go to the lowest index).
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_i = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
        take = x > lane_max
        lane_i = tl.where(take, start + offs, lane_i)
        lane_max = tl.where(take, x, lane_max)
    best = tl.max(lane_max, 0)
    best_i = tl.min(tl.where(lane_max == best, lane_i, vocab), 0)
    # Pass 2: the normalisers at temperature 1 (for the chosen token's log-probability) and at T.
    temperature = tl.load(Temperature + row)
    inv_t = 1.0 / tl.where(temperature == 0.0, 1.0, temperature)
    raw_total = tl.zeros((BLOCK,), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
        raw_total += tl.exp(x - best)
        total += tl.exp((x - best) * inv_t)  # e_i = exp((x_i - max) / T): p_i up to `total`; the top token has e = 1
    raw_total = tl.sum(raw_total, 0)
    total = tl.sum(total, 0)
    token = best_i
    if temperature != 0.0:
        top_k = tl.load(TopK + row)
        top_p = tl.load(TopP + row)
        threshold = tl.load(MinP + row)  # min_p: e >= min_p * max e
        if (top_k < vocab) | (top_p < 1.0):
            # Largest e-threshold keeping >= top_k tokens, and largest keeping >= top_p of the mass: a search
            # over float bit patterns in [lo, hi), testing 15 cut points per pass (8 passes narrow 2^30 to 1).
            cut = tl.arange(0, 16)
            k_lo = tl.full((), 0, tl.int32)
            k_hi = tl.full((), _ONE_BITS + 1, tl.int32)
            p_lo = tl.full((), 0, tl.int32)
            p_hi = tl.full((), _ONE_BITS + 1, tl.int32)
            for _ in range(8):
                k_cuts = k_lo + ((k_hi - k_lo).to(tl.int64) * cut // 16).to(tl.int32)  # cut 0 is lo: always ok
                p_cuts = p_lo + ((p_hi - p_lo).to(tl.int64) * cut // 16).to(tl.int32)
                k_t = k_cuts.to(tl.float32, bitcast=True)[:, None]
                p_t = p_cuts.to(tl.float32, bitcast=True)[:, None]
                count = tl.zeros((16, SEARCH_BLOCK), tl.int32)  # reduced once per pass, not per tile
                mass = tl.zeros((16, SEARCH_BLOCK), tl.float32)
                for start in range(0, vocab, SEARCH_BLOCK):
                    idx = start + tl.arange(0, SEARCH_BLOCK)
                    x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                    e = tl.exp((x - best) * inv_t)[None, :]
                    count += (e >= k_t).to(tl.int32)
                    mass += tl.where(e >= p_t, e, 0.0)
                count = tl.sum(count, 1)
                mass = tl.sum(mass, 1)
                # The conditions hold for a prefix of the cuts: lo moves to the last passing cut, hi to the next.
                k_last = tl.max(tl.where(count >= top_k, cut, 0), 0)
                p_last = tl.max(tl.where(mass >= top_p * total, cut, 0), 0)
                k_hi = tl.where(k_last == 15, k_hi, tl.sum(tl.where(cut == k_last + 1, k_cuts, 0), 0))
                p_hi = tl.where(p_last == 15, p_hi, tl.sum(tl.where(cut == p_last + 1, p_cuts, 0), 0))
                k_lo = tl.sum(tl.where(cut == k_last, k_cuts, 0), 0)
                p_lo = tl.sum(tl.where(cut == p_last, p_cuts, 0), 0)
            threshold = tl.maximum(threshold, tl.maximum(k_lo.to(tl.float32, bitcast=True),
                                                         p_lo.to(tl.float32, bitcast=True)))
        threshold = tl.minimum(threshold, 1.0)  # the most likely token always survives
        # The race: maximise log e_i - log E_i over kept tokens.
        seed = tl.load(Seed + row)
        lane_win = tl.full((BLOCK,), float("-inf"), tl.float32)
        lane_i = tl.zeros((BLOCK,), tl.int32) + best_i
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
            z = (x - best) * inv_t
            u = tl.rand(seed, idx)
            score = z - tl.log(-tl.log(u))
            score = tl.where((tl.exp(z) >= threshold) & (idx < vocab), score, float("-inf"))
            take = score > lane_win
            lane_i = tl.where(take, idx, lane_i)
            lane_win = tl.where(take, score, lane_win)
        win = tl.max(lane_win, 0)
        token = tl.min(tl.where(lane_win == win, lane_i, vocab), 0)
    tl.store(Out + row, token.to(tl.int64))
    tl.store(OutLogprob + row, tl.load(base + token).to(tl.float32) - best - tl.log(raw_total))


def sample(logits, temperature, top_k, top_p, min_p, seeds):
    """logits [B, V] -> (token ids [B] int64, their log-probabilities under softmax(logits) [B] float32). Per row:
    temperature (0 = greedy), top_k (>= V: off), top_p, min_p (float32 tensors, top_k int32) and seeds (int64)."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch:
        _sample_kernel[(batch,)](logits, out, logprobs, temperature, top_k, top_p, min_p, seeds, logits.stride(0), vocab,
                                 BLOCK=min(triton.next_power_of_2(vocab), 2048),
                                 SEARCH_BLOCK=min(triton.next_power_of_2(vocab), 256), num_warps=8)
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
