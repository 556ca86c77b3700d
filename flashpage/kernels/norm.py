"""RMSNorm over rows: transformers' order of roundings (normalise in float32, round, then scale)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels import pdl
from flashpage.kernels.pdl import release_next, wait_for_previous


@triton.jit
def rms_normalize(h, Weight, cols, ok, n_cols, eps, dtype):
    """One row h (float32, zero past n_cols) normalised and scaled, rounded to `dtype` where the model rounds."""
    h = h * tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    h = h.to(dtype).to(tl.float32)
    return (tl.load(Weight + cols, mask=ok, other=0.0).to(tl.float32) * h).to(dtype)


@triton.jit
def _rms_norm_kernel(X, Weight, Out, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    release_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    h = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, rms_normalize(h, Weight, cols, ok, n_cols, eps, Out.dtype.element_ty),
             mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> weight * x / rms(x), row by row."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm needs x [tokens, {weight.shape[0]}] with unit stride, got {tuple(x.shape)}")
    out = torch.empty_like(x)
    if x.shape[0]:
        early = pdl.enabled(x.device)
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps,
                                        BLOCK=triton.next_power_of_2(x.shape[1]), PDL=early, launch_pdl=early,
                                        num_warps=4 if x.shape[1] <= 4096 else 8)
    return out
