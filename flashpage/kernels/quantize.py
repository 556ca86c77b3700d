"""Per-row (per-token) FP8 quantization of activations in one kernel, for the scaled matmul of FP8 layers: the
arithmetic of `flashpage.kernels.fp8.quantize_rows` (the same scales; values can differ by one e4m3 step, as
Triton's float32 division is not IEEE-exact), which as separate PyTorch operations took as long as the FP8
matmul it feeds (docs/kernel-notes.md). One program holds a whole row in registers: one read, its largest
magnitude, then scale, round and store. The RMSNorm in front of a projection can run in the same program
(`norm_weight`), so the normalised row is never written out in 16 bits and read back."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.fp8 import FP8, FP8_MAX
from flashpage.kernels.norm import rms_normalize


@triton.jit
def _quantize_rows_kernel(X, NormWeight, Q, Scale, K, stride_x, stride_q, eps, FMAX: tl.constexpr,
                          NORM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    ok = k < K
    x = tl.load(X + row * stride_x + k, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        x = rms_normalize(x, NormWeight, k, ok, K, eps, X.dtype.element_ty).to(tl.float32)
    largest = tl.max(tl.abs(x), axis=0)
    scale = tl.where(largest > 0, largest / FMAX, 1.0)
    tl.store(Scale + row, scale)
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    tl.store(Q + row * stride_q + k, q.to(Q.dtype.element_ty), mask=ok)


def quantize_rows(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], float32 scales [R]), x ≈ q * scale[:, None]; with `norm_weight`, of
    rms_norm(x, norm_weight, eps) instead (`flashpage.kernels.norm`'s roundings)."""
    if x.stride(-1) != 1:
        raise ValueError("quantize_rows needs rows with unit stride")
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _quantize_rows_kernel[(x.shape[0],)](x, x if norm_weight is None else norm_weight, q, scale, x.shape[1],
                                             x.stride(0), q.stride(0), eps, FMAX=FP8_MAX, NORM=norm_weight is not None,
                                             BLOCK=block, num_warps=min(max(block // 1024, 4), 16))
    return q, scale
