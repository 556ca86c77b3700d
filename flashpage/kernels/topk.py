"""Top-k positions of each row by radix select: SparQ's choice of keys (`flashpage.kernels.sparq`).

torch.topk took about 70 us per layer at 128k keys (its radix select runs as seven kernels over sixteen-bit
digits, docs/kernel-notes.md). Here a row's values are non-negative float32 (negative: not a candidate), whose
bits order them as integers. Three passes over 10-, 11- and 10-bit digits of those bits each count, over the
candidates that share the digits chosen so far, how many have each next digit (`count_digits`, one histogram per
chunk of a row, added into the row's with atomics; SparQ's aggregation does the first pass as it writes the
values), and `_choose_digit` keeps the digit holding the k-th largest; the bits so chosen are the k-th largest
value T. `_select` then writes the positions of the values above T and as many equal to T as make k. Positions
come out in no particular order; a row with fewer than k candidates gets them all, at its front.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PASSES = ((21, 10), (10, 11), (0, 10))  # (shift, bits) of each pass's digit, high bits first
NUM_BINS = tl.constexpr(2048)  # (a constexpr: kernels read it)
STATE = 2048 + 4  # per row: the histogram, then the value so far, how many of it to take, two counters


@triton.jit
def order_key(x):
    """A value's place in the order as a positive int32: its float bits + 1 (0: not a candidate)."""
    return tl.where(x >= 0, x.to(tl.int32, bitcast=True) + 1, 0)


@triton.jit
def count_digits(key, ok, State, row, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr):
    """Add the digits at SHIFT of the candidates `key` (where `ok`) that share the bits chosen so far to the row's
    histogram."""
    ok = ok & (key > 0)
    if not FIRST:
        chosen = tl.load(State + row * (NUM_BINS + 4) + NUM_BINS)
        ok = ok & ((key >> (SHIFT + BITS)) == (chosen >> (SHIFT + BITS)))
    counts = tl.histogram((key >> SHIFT) & ((1 << BITS) - 1), NUM_BINS, mask=ok)
    tl.atomic_add(State + row * (NUM_BINS + 4) + tl.arange(0, NUM_BINS), counts, mask=counts > 0)


@triton.jit
def _count(Values, State, length, stride_row, SHIFT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = order_key(tl.load(Values + row * stride_row + i, mask=i < length, other=-1.0))
    count_digits(key, i < length, State, row, SHIFT, BITS, False)


@triton.jit
def _choose_digit(State, k, SHIFT: tl.constexpr, FIRST: tl.constexpr):
    """The digit at SHIFT of the k-th largest candidate: the largest digit d with at least `remaining` candidates
    at or above it. Clears the histogram for the next pass."""
    row = tl.program_id(0)
    base = State + row * (NUM_BINS + 4)
    d = tl.arange(0, NUM_BINS)
    counts = tl.load(base + d)
    remaining = k if FIRST else tl.load(base + NUM_BINS + 1)
    chosen = 0 if FIRST else tl.load(base + NUM_BINS)
    at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
    digit = tl.max(tl.where(at_or_above >= remaining, d, 0), 0)  # (0 where fewer than k: every candidate is taken)
    above = tl.sum(tl.where(d > digit, counts, 0), 0)
    tl.store(base + NUM_BINS, chosen | (digit << SHIFT))
    tl.store(base + NUM_BINS + 1, remaining - above)
    tl.store(base + d, tl.zeros_like(counts))


@triton.jit
def _select(Values, State, Out, length, k, stride_row, stride_out, BLOCK: tl.constexpr):
    """Positions of the values above T into Out[row, :k - r], and of r values equal to T after them."""
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = order_key(tl.load(Values + row * stride_row + i, mask=i < length, other=-1.0))
    base = State + row * (NUM_BINS + 4)
    threshold = tl.load(base + NUM_BINS)
    ties = tl.load(base + NUM_BINS + 1)
    above = key > threshold
    n_above = tl.sum(above.to(tl.int32), 0)
    first = tl.atomic_add(base + NUM_BINS + 2, n_above)
    at = first + tl.cumsum(above.to(tl.int32), 0) - 1
    tl.store(Out + row * stride_out + at, i, mask=above)
    equal = (key == threshold) & (key > 0)
    n_equal = tl.sum(equal.to(tl.int32), 0)
    first = tl.atomic_add(base + NUM_BINS + 3, n_equal)
    at = first + tl.cumsum(equal.to(tl.int32), 0) - 1
    tl.store(Out + row * stride_out + (k - ties) + at, i, mask=equal & (at < ties))


def new_state(rows: int, device) -> torch.Tensor:
    """The select's scratch for `rows` rows, zeroed (histograms, chosen bits, counters)."""
    return torch.zeros(rows, STATE, dtype=torch.int32, device=device)


def topk_positions(values: torch.Tensor, k: int, state: torch.Tensor | None = None, counted: bool = False,
                   block: int = 4096) -> torch.Tensor:
    """values [rows, length] float32 (negative: not a candidate) -> int32 [rows, k]: positions of each row's k
    largest candidates, in no order (ties at the k-th value broken by whichever chunk came first); a row with c < k
    candidates has them at [:c] and anything after. `counted`: the first pass's digits are already in `state` (a
    kernel that wrote `values` counted them with `count_digits`)."""
    rows, length = values.shape
    state = new_state(rows, values.device) if state is None else state
    out = torch.empty(rows, k, dtype=torch.int32, device=values.device)
    if rows == 0 or k == 0:
        return out
    chunks = triton.cdiv(length, block)
    for n, (shift, bits) in enumerate(PASSES):
        if n or not counted:
            _count[(rows, chunks)](values, state, length, values.stride(0), SHIFT=shift, BITS=bits, BLOCK=block)
        _choose_digit[(rows,)](state, k, SHIFT=shift, FIRST=n == 0)
    _select[(rows, chunks)](values, state, out, length, k, values.stride(0), out.stride(0), BLOCK=block)
    return out
