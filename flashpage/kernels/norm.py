"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, Residual, Weight, Out, ResidualOut, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:  # h = x + residual, rounded to the model dtype as the unfused model does
        x = (x.to(tl.float32) + tl.load(Residual + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(ResidualOut.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + cols, x, mask=ok)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    # Normalise in float32, round to the model dtype, then scale (transformers' order of roundings).
    h = h.to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(Weight + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * h).to(Out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, H] -> (weight * norm(h), h) where h = x + residual (or x when residual is None)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm needs x [tokens, {weight.shape[0]}] with unit stride, got {tuple(x.shape)}")
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if x.shape[0]:
        r = residual if residual is not None else x
        _rms_norm_kernel[(x.shape[0],)](x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0),
                                        res_out.stride(0), x.shape[1], eps, HAS_RESIDUAL=residual is not None,
                                        BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4 if x.shape[1] <= 4096 else 8)
    return out, res_out
