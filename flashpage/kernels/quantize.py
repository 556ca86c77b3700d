"""Per-row (per-token) FP8 quantization of activations in one kernel, for the scaled matmul of FP8 layers: the
arithmetic of `flashpage.kernels.fp8.quantize_rows` (the same scales; values can differ by one e4m3 step, as
Triton's float32 division is not IEEE-exact), which as separate PyTorch operations took as long as the FP8
matmul it feeds (docs/kernel-notes.md). One program per row: a pass for the row's largest magnitude, a pass
that scales, rounds and stores."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.fp8 import FP8, FP8_MAX


@triton.jit
def _quantize_rows_kernel(X, Q, Scale, K, stride_x, stride_q, FMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = X + row * stride_x, Q + row * stride_q
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
    largest = tl.max(amax, axis=0)
    scale = tl.where(largest > 0, largest / FMAX, 1.0)
    tl.store(Scale + row, scale)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
        tl.store(q_row + k, q.to(Q.dtype.element_ty), mask=k < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], float32 scales [R]), x ≈ q * scale[:, None]."""
    if x.stride(-1) != 1:
        raise ValueError("quantize_rows needs rows with unit stride")
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _quantize_rows_kernel[(x.shape[0],)](x, q, scale, x.shape[1], x.stride(0), q.stride(0), FMAX=FP8_MAX,
                                             BLOCK=1024, num_warps=4)
    return q, scale
