"""The positions of each row's k largest values, in position order, the first ones taken among equal values
(`reference.top_k_positions`), in one of two ways:
- rows of up to MAX_ROW values (`block_sparse.choose_blocks`' candidate blocks): one program per row holds it in
  registers and finds its k-th largest value a bit at a time, from the highest (is the count of values at or above
  the bits found so far plus this one still k or more?), then writes the positions of the values above it and of
  the first values equal to it, as many as k still needs. 4,096 rows of 512 on an H200: 23 µs, where torch's
  top-k, a where and a sort took 206 µs;
- longer rows (SparQ's keys) are cut into chunks of CHUNK (SHORT_CHUNK where that would leave SMs without a
  program), a program each, in a radix select RADIX_BITS bits at
  a time: one launch per digit counts, in a histogram of 2 ** RADIX_BITS bins per row, that digit of the values
  that share the digits found so far, the last one also keeping each chunk's own counts; from those the last
  launch knows how many values above the k-th largest and equal to it the chunks before its own hold, and writes
  the positions, each chunk after the ones before it (docs/kernel-notes.md).

The values are probabilities and block masses: non-negative floats order as their bits do. Anything below zero
(SparQ's -1 past a sequence's end, a mass's -inf where a row has no more candidates) ranks under every
non-negative value, and is taken, first positions first, only where a row holds fewer than k of those.
`drop_bits` ranks the values by their bits less that many of the lowest: values that then agree are ties (SparQ's
fp16 sums rank by their exponent alone, one radix digit instead of three; infinity then ties with the largest
finite exponent). Where one digit is all a key has, the kernel that counts it for the select (`count_first_digits`)
also keeps each of its chunks' counts, and the select is one launch: the write."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from flashpage.kernels.device import sm_count

MAX_ROW = 4096  # longest row held in registers by one program
CHUNK = 4096  # values per program in rows longer than that
# ... where CHUNK gives fewer programs than the GPU has SMs (SparQ at batch 1 and 32k: 8 rows of 8 chunks): SparQ's
# step 41 µs instead of 45 there; where CHUNK fills the SMs, smaller chunks were as fast or slower
# (docs/kernel-notes.md)
SHORT_CHUNK = 1024
# bits per digit: tl.histogram's cost grows with its bins (a ballot per bit, a popcount per bin a lane holds),
# and 32 bins, one a lane, cost a sixth of 256 (docs/kernel-notes.md)
RADIX_BITS = 5
_RADIX_BITS = tl.constexpr(RADIX_BITS)
_BINS = tl.constexpr(2**RADIX_BITS)


@triton.jit
def _key(x, KEY_BITS: tl.constexpr, DROP_BITS: tl.constexpr):
    """x's rank as an integer under 2 ** (KEY_BITS - 1 - DROP_BITS): its bits but the lowest DROP_BITS, plus one,
    where x >= 0, else 0 (the largest rank, where the plus one would reach that bound, is infinity's too)."""
    if KEY_BITS == 16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        bits = x.to(tl.int32, bitcast=True)
    return tl.where(x >= 0, tl.minimum((bits >> DROP_BITS) + 1, (1 << (KEY_BITS - 1 - DROP_BITS)) - 1), 0)


@triton.jit
def _row_in_registers_kernel(Values, Ks, Out, k, n, width, fill, stride_v, stride_o, KEY_BITS: tl.constexpr,
                             DROP_BITS: tl.constexpr, PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
                             BLOCK_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PER_ROW:
        k = tl.load(Ks + row)
    k = tl.minimum(k, n)
    i = tl.arange(0, BLOCK)
    ok = i < n
    key = tl.where(ok, _key(tl.load(Values + row * stride_v + i, mask=ok, other=-1.0), KEY_BITS, DROP_BITS), -1)
    threshold = 0  # the k-th largest key: the largest t with k or more keys >= t
    for bit in tl.static_range(KEY_BITS - 1 - DROP_BITS):  # (keys are under 2 ** (KEY_BITS - 1 - DROP_BITS))
        candidate = threshold | (1 << (KEY_BITS - 2 - DROP_BITS - bit))
        if tl.sum((key >= candidate).to(tl.int32), 0) >= k:
            threshold = candidate
    # the keys above it, and as many equal to it as k still needs, the first ones
    tie = (key == threshold).to(tl.int32)
    want = k - tl.sum((key > threshold).to(tl.int32), 0)
    taken = (key > threshold) | ((tie == 1) & (tl.cumsum(tie, 0) - tie < want))
    taken &= k > 0
    tl.store(Out + row * stride_o + tl.cumsum(taken.to(tl.int32), 0) - 1, i, mask=taken)
    j = tl.arange(0, BLOCK_W)
    tl.store(Out + row * stride_o + j, fill, mask=(j >= k) & (j < width))


def _levels(key_bits: int, drop_bits: int) -> int:
    """Digits in a key (keys are under 2 ** (key_bits - 1 - drop_bits))."""
    return triton.cdiv(key_bits - 1 - drop_bits, RADIX_BITS)


@triton.jit
def _threshold(Hist, row, k, LEVEL: tl.constexpr, LEVELS: tl.constexpr):
    """The first LEVEL digits of the row's k-th largest key, from its histograms, and how many of the keys that
    share them are still to be taken."""
    bins = tl.arange(0, _BINS)
    threshold = 0
    want = tl.maximum(k, 1)
    for level in tl.static_range(LEVEL):
        counts = tl.load(Hist + (row * LEVELS + level) * _BINS + bins)
        at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
        digit = tl.max(tl.where(at_or_above >= want, bins, 0), 0)
        want -= tl.sum(tl.where(bins == digit, at_or_above - counts, 0), 0)  # the keys above its digit: all taken
        threshold = threshold * _BINS + digit
    return threshold, want


@triton.jit
def _chunk_keys(Values, Ks, k, n, stride_v, KEY_BITS: tl.constexpr, DROP_BITS: tl.constexpr, PER_ROW: tl.constexpr,
                CHUNK: tl.constexpr):
    """The program's row, that row's k (at most n), and its chunk's positions and keys (-1 past n)."""
    row = tl.program_id(0).to(tl.int64)
    if PER_ROW:
        k = tl.load(Ks + row)
    i = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = i < n
    key = tl.where(ok, _key(tl.load(Values + row * stride_v + i, mask=ok, other=-1.0), KEY_BITS, DROP_BITS), -1)
    return row, tl.minimum(k, n), i, key


@triton.jit
def _store_chunk_counts(ChunkHist, ChunkAbove, at, counts, above_prefix):
    """A chunk's counts of the last digit, and of its keys above each value of that digit (above_prefix: those
    above the digits before it): what the write needs of the chunks before its own."""
    tl.store(ChunkHist + at, counts)
    tl.store(ChunkAbove + at, above_prefix + tl.sum(counts, 0) - tl.cumsum(counts, 0))


@triton.jit
def count_first_digits(Hist, ChunkHist, ChunkAbove, row, chunk, num_chunks, values, ok, LEVELS: tl.constexpr,
                       KEY_BITS: tl.constexpr, DROP_BITS: tl.constexpr):
    """Adds the first digits of a row's values (where ok) to its histogram: a kernel that writes the values counts
    them as it does (`FirstDigits`), saving that launch's read. Where that digit is the only one, it also keeps
    the counts of this program's values, chunk `chunk` of the row's `num_chunks`."""
    key = _key(values, KEY_BITS, DROP_BITS)
    counts = tl.histogram(key >> (_RADIX_BITS * (LEVELS - 1)), _BINS, mask=ok)
    bins = tl.arange(0, _BINS)
    tl.atomic_add(Hist + row * LEVELS * _BINS + bins, counts, mask=counts > 0)
    if LEVELS == 1:
        _store_chunk_counts(ChunkHist, ChunkAbove, (row * num_chunks + chunk) * _BINS + bins, counts, 0)


@triton.jit
def _histogram_kernel(Values, Ks, Hist, ChunkHist, ChunkAbove, k, n, stride_v, LEVEL: tl.constexpr,
                      LEVELS: tl.constexpr, KEY_BITS: tl.constexpr, DROP_BITS: tl.constexpr, PER_ROW: tl.constexpr,
                      CHUNK: tl.constexpr):
    """Adds the chunk's histogram of the level's digit to its row's. At the last level it also keeps, for each
    value of that digit, how many of the chunk's keys would equal the threshold and how many would be above it: what
    the write needs of the chunks before its own."""
    row, k, i, key = _chunk_keys(Values, Ks, k, n, stride_v, KEY_BITS, DROP_BITS, PER_ROW, CHUNK)
    shift = _RADIX_BITS * (LEVELS - 1 - LEVEL)
    ok = key >= 0
    prefix = 0
    if LEVEL > 0:
        prefix, _ = _threshold(Hist, row, k, LEVEL, LEVELS)
        ok &= (key >> (shift + _RADIX_BITS)) == prefix
    counts = tl.histogram((key >> shift) & (_BINS - 1), _BINS, mask=ok)
    bins = tl.arange(0, _BINS)
    tl.atomic_add(Hist + (row * LEVELS + LEVEL) * _BINS + bins, counts, mask=counts > 0)
    if LEVEL == LEVELS - 1:
        above_prefix = tl.sum(((key >> _RADIX_BITS) > prefix).to(tl.int32), 0)
        _store_chunk_counts(ChunkHist, ChunkAbove, (row * tl.num_programs(1) + tl.program_id(1)) * _BINS + bins,
                            counts, above_prefix)


@triton.jit
def _write_kernel(Values, Ks, Hist, ChunkHist, ChunkAbove, Out, k, n, width, fill, num_counted, stride_v, stride_o,
                  LEVELS: tl.constexpr, KEY_BITS: tl.constexpr, DROP_BITS: tl.constexpr, PER_ROW: tl.constexpr,
                  CHUNK: tl.constexpr, COUNTED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """Writes the positions of the chunk's taken keys. ChunkHist and ChunkAbove hold the counts of chunks of
    COUNTED keys (num_counted to a row), a divisor of CHUNK."""
    row, k, i, key = _chunk_keys(Values, Ks, k, n, stride_v, KEY_BITS, DROP_BITS, PER_ROW, CHUNK)
    threshold, want = _threshold(Hist, row, k, LEVELS, LEVELS)
    # the keys above the threshold and equal to it in the chunks before this one
    c = tl.arange(0, BLOCK_C)
    before = c < tl.program_id(1) * (CHUNK // COUNTED)
    at = (row * num_counted + c) * _BINS + (threshold & (_BINS - 1))
    above_before = tl.sum(tl.load(ChunkAbove + at, mask=before, other=0), 0)
    ties_before = tl.sum(tl.load(ChunkHist + at, mask=before, other=0), 0)
    room = tl.maximum(want - ties_before, 0)  # the ties this chunk may still take, its first ones
    # one scan counts both, the keys above in the low half and the ties in the high (CHUNK < 2 ** 16)
    above = (key > threshold).to(tl.int32)
    tie = (key == threshold).to(tl.int32)
    packed = above + (tie << 16)
    before_i = tl.cumsum(packed, 0) - packed
    ties_before_i = before_i >> 16
    taken = (above == 1) | ((tie == 1) & (ties_before_i < room))
    taken &= k > 0
    slot = above_before + tl.minimum(ties_before, want) + (before_i & 0xFFFF) + tl.minimum(ties_before_i, room)
    tl.store(Out + row * stride_o + slot, i, mask=taken)
    if tl.program_id(1) == 0:
        j = tl.arange(0, BLOCK_W)
        tl.store(Out + row * stride_o + j, fill, mask=(j >= k) & (j < width))


@dataclasses.dataclass
class FirstDigits:
    """The first digits of a select's values, counted by the kernel that writes the values (`count_first_digits`)
    for `top_k_positions(..., first_digits=)`: `hist` [rows, levels, bins], each row's histograms (the first
    level counted, the others zeroed); where one digit is all a key has, also `chunk_hist` and `chunk_above`
    [rows, chunks, bins], each chunk of `chunk` values' own counts (the select's chunks must be multiples of it)."""

    hist: torch.Tensor
    chunk_hist: torch.Tensor
    chunk_above: torch.Tensor
    chunk: int

    @property
    def levels(self) -> int:
        return self.hist.shape[1]


def digit_counts(values: torch.Tensor, chunk: int, zeroed: bool = True, drop_bits: int = 0) -> FirstDigits:
    """Room for the counts of a kernel that writes `values` in programs of `chunk` of a row's values: histograms
    zeroed, or with zeroed=False left for a kernel that runs before them to zero."""
    rows, n = values[..., 0].numel(), values.shape[-1]
    levels = _levels(8 * values.element_size(), drop_bits)
    hist = (torch.zeros if zeroed else torch.empty)(rows, levels, 2**RADIX_BITS, dtype=torch.int32,
                                                    device=values.device)
    chunks = triton.cdiv(n, chunk) if levels == 1 else 0
    chunk_hist, chunk_above = (torch.empty(rows, chunks, 2**RADIX_BITS, dtype=torch.int32, device=values.device)
                               for _ in range(2))
    return FirstDigits(hist, chunk_hist, chunk_above, chunk)


def top_k_positions(values: torch.Tensor, k, width: int | None = None, fill: int = 0,
                    dtype: torch.dtype = torch.int32, first_digits: FirstDigits | None = None,
                    drop_bits: int = 0) -> torch.Tensor:
    """`reference.top_k_positions` (the same positions): [..., width] (width = k by default), the slots past a
    row's k set to fill; a k over width takes the width largest. k: an int, or a tensor of one per row.
    first_digits: `digit_counts(values, ..., drop_bits=drop_bits)` with the values' first digits counted
    (`count_first_digits`), or None."""
    n = values.shape[-1]
    per_row = isinstance(k, torch.Tensor)
    width = width if width is not None else k
    k = k.clamp(max=width) if per_row else min(k, width)  # (as the reference: no more than width)
    rows = values.reshape(-1, n)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=dtype, device=values.device)
    ks = k.reshape(-1) if per_row else out
    key_bits = 8 * values.element_size()
    if not 0 <= drop_bits < key_bits - 1:
        raise ValueError(f"drop_bits must leave {values.dtype} keys a bit at least, got {drop_bits}")
    if rows.shape[0] == 0 or width == 0:
        pass
    elif n > MAX_ROW:
        chunk = CHUNK
        if values.is_cuda and rows.shape[0] * triton.cdiv(n, CHUNK) < sm_count(values.device):
            chunk = min(CHUNK, SHORT_CHUNK)
        grid = (rows.shape[0], triton.cdiv(n, chunk))
        levels = _levels(key_bits, drop_bits)
        counts = digit_counts(values, chunk, drop_bits=drop_bits) if first_digits is None else first_digits
        if levels > 1:  # the last digit's histogram launch keeps the counts of the select's own chunks
            counts = dataclasses.replace(counts, chunk=chunk, **{
                name: torch.empty(*grid, 2**RADIX_BITS, dtype=torch.int32, device=values.device)
                for name in ("chunk_hist", "chunk_above")})
        elif chunk % counts.chunk:
            raise ValueError(f"first digits counted in chunks of {counts.chunk}: not a divisor of {chunk}")
        scalar_k = 0 if per_row else k
        for level in range(0 if first_digits is None else 1, levels):
            _histogram_kernel[grid](rows, ks, counts.hist, counts.chunk_hist, counts.chunk_above, scalar_k, n,
                                    rows.stride(0), LEVEL=level, LEVELS=levels, KEY_BITS=key_bits,
                                    DROP_BITS=drop_bits, PER_ROW=per_row, CHUNK=chunk, num_warps=4)
        num_counted = counts.chunk_hist.shape[1]
        _write_kernel[grid](rows, ks, counts.hist, counts.chunk_hist, counts.chunk_above, out, scalar_k, n, width,
                            fill, num_counted, rows.stride(0), out.stride(0), LEVELS=levels, KEY_BITS=key_bits,
                            DROP_BITS=drop_bits, PER_ROW=per_row, CHUNK=chunk, COUNTED=counts.chunk,
                            BLOCK_C=triton.next_power_of_2(num_counted), BLOCK_W=triton.next_power_of_2(width),
                            num_warps=4)
    else:
        block = triton.next_power_of_2(max(n, 16))
        _row_in_registers_kernel[(rows.shape[0],)](
            rows, ks, out, 0 if per_row else k, n, width, fill, rows.stride(0), out.stride(0), KEY_BITS=key_bits,
            DROP_BITS=drop_bits, PER_ROW=per_row, BLOCK=block, BLOCK_W=triton.next_power_of_2(width),
            num_warps=max(1, min(8, block // 512)))
    return out.view(*values.shape[:-1], width)
