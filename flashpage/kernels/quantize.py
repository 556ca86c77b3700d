"""FP8 quantization kernels, the arithmetic of `flashpage.kernels.fp8`'s (the same scales; values can differ by one
e4m3 step, as Triton's float32 division is not IEEE-exact), which as separate PyTorch operations took as long as
the products they feed (docs/kernel-notes.md).

- Per row (token), for the scaled matmul of FP8 layers: one program holds a whole row in registers: one read, its
  largest magnitude, then scale, round and store. The RMSNorm in front of a projection can run in the same program
  (`norm_weight`), and so can the SiLU-and-mul in front of down_proj (`silu_mul`), so the normalised or
  activated row is never written out in 16 bits and read back.
- Per head, for FP8 attention: one pass over the tokens, written wherever the attention kernel wants each token
  (`quantize_heads`' `out` and `rows`), transposed included.

Every kernel that writes e4m3 (these, the FP8 KV cache's writes, SparQ's copy) rounds through `to_e4m3`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.activation import silu_mul
from flashpage.kernels.device import interpreting
from flashpage.kernels.fp8 import FP8, FP8_MAX, head_scales
from flashpage.kernels.norm import rms_normalize

_INTERPRET = tl.constexpr(interpreting())
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_e4m3(x):
    """float32 x saturated to +-FP8_MAX and rounded to e4m3 (to nearest, ties to even), as torch rounds it: every
    kernel that writes e4m3 writes it so. The GPU converts in one instruction; Triton 3.6's interpreter drops the
    carry of a rounding that overflows the mantissa (1.955 -> 1.0) and gets subnormals wrong, so there the bits
    are made here."""
    x = tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX)
    if not _INTERPRET:
        return x.to(tl.float8e4nv)
    a = tl.abs(x)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0)  # the binade (subnormals: that of 2 ** -6)
    units = a * tl.exp2(3.0 - e)  # in steps of the binade's spacing, 2 ** (e - 3)
    units = (units + 12582912.0) - 12582912.0  # rounded to an integer, ties to even (float32's own rounding)
    e = tl.where(units >= 16.0, e + 1.0, e)  # a carry into the next binade
    units = tl.where(units >= 16.0, units * 0.5, units)
    normal = units >= 8.0
    bits = tl.where(normal, (e + 7.0) * 8.0 + units - 8.0, units).to(tl.int32)  # exponent field, mantissa
    bits = tl.where(x < 0, bits | 0x80, bits)
    return bits.to(tl.int8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _quantize_rows_kernel(X, NormWeight, Q, Scale, K, stride_x, stride_q, eps, NORM: tl.constexpr,
                          SILU_MUL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    ok = k < K
    x = tl.load(X + row * stride_x + k, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        x = rms_normalize(x, NormWeight, k, ok, K, eps, X.dtype.element_ty).to(tl.float32)
    if SILU_MUL:  # x is the gate; the up projection follows it in the row
        x = silu_mul(x, tl.load(X + row * stride_x + K + k, mask=ok, other=0.0).to(tl.float32), X.dtype.element_ty)
    largest = tl.max(tl.abs(x), axis=0)
    scale = tl.where(largest > 0, largest / _FP8_MAX, 1.0)
    tl.store(Scale + row, scale)
    tl.store(Q + row * stride_q + k, to_e4m3(x / scale), mask=ok)


def quantize_rows(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                  silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], float32 scales [R]), x ≈ q * scale[:, None]; with `norm_weight`, of
    rms_norm(x, norm_weight, eps) instead (`flashpage.kernels.norm`'s roundings); with `silu_mul`, x [R, 2C] is
    [gate | up] and the rows quantized are silu_and_mul(x)'s (`flashpage.kernels.activation`'s roundings)."""
    if x.stride(-1) != 1:
        raise ValueError("quantize_rows needs rows with unit stride")
    cols = x.shape[1] // 2 if silu_mul else x.shape[1]
    q = torch.empty((x.shape[0], cols), dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(cols)
        _quantize_rows_kernel[(x.shape[0],)](x, x if norm_weight is None else norm_weight, q, scale, cols,
                                             x.stride(0), q.stride(0), eps, NORM=norm_weight is not None,
                                             SILU_MUL=silu_mul, BLOCK=block, num_warps=min(max(block // 1024, 4), 16))
    return q, scale


@triton.jit
def _quantize_heads_kernel(X, Scale, Out, Rows, T, stride_xt, stride_xh, stride_ot, stride_oh, stride_od,
                           ROWS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    ok = (t < T)[:, None]
    x = tl.load(X + t.to(tl.int64)[:, None] * stride_xt + head * stride_xh + d[None, :], mask=ok, other=0.0)
    q = to_e4m3(x.to(tl.float32) / tl.load(Scale + head))
    row = tl.load(Rows + t, mask=t < T, other=0).to(tl.int64) if ROWS else t.to(tl.int64)
    tl.store(Out + row[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od, q,
             mask=ok)


def quantize_heads(x: torch.Tensor, out: torch.Tensor | None = None, rows: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (e4m3, float32 scales [H]) with one scale per head (`flashpage.kernels.fp8.quantize_heads`):
    written to `out` (new [T, H, D], or any view indexed [row, head, d], a transposed one included), token t at
    row rows[t] (default t)."""
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1 or dim & (dim - 1):
        raise ValueError("quantize_heads needs a power-of-two head dim with unit stride")
    scale = head_scales(x)
    out = torch.empty(x.shape, dtype=FP8, device=x.device) if out is None else out
    if tokens:
        block = max(1, 4096 // dim)
        _quantize_heads_kernel[(triton.cdiv(tokens, block), heads)](
            x, scale, out, x if rows is None else rows, tokens, x.stride(0), x.stride(1), *out.stride(),
            ROWS=rows is not None, D=dim, BLOCK_T=block, num_warps=4)
    return out, scale
