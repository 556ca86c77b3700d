"""SiLU-and-multiply: the gated MLP's activation, reading gate and up from the fused gate_up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up, from float32 tensors holding values of `dtype`, rounded to `dtype` where the unfused model
    rounds (silu(gate), then the product); returned as float32."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, silu_mul(gate, up, Out.dtype.element_ty).to(Out.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] = [gate | up] -> silu(gate) * up, [T, I]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul needs x [tokens, 2 * intermediate] with unit stride, got {tuple(x.shape)}")
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out
