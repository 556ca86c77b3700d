"""FP8 (e4m3) linear layers: weights quantized per output channel, activations per token (row), both scaled by
their largest magnitude over 448 (e4m3's largest finite value).

A product y = x @ W.T with W = Wq * s_w[:, None] and x = xq * s_x[:, None] is y = (xq @ Wq.T) * s_x[:, None] *
s_w[None, :]: the tensor cores multiply the FP8 values and the scales are applied to the float32 sums. On CUDA
that is `torch._scaled_mm` with row-wise scales (cuBLASLt); the reference does the same arithmetic in float32. The
decode path (a handful of rows, bound by reading the weights) keeps its activations in 16 bits and dequantizes
the FP8 weights in registers instead (`flashpage.kernels.linear`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class QuantizedRows:
    """Activations already quantized per row, standing for values * scales[:, None] in `dtype`: what an FP8
    projection turns its input into first, handed over in this form by the kernel that made them (SiLU-and-mul
    before down_proj) so that they are never written out in 16 bits and read back."""
    values: torch.Tensor  # e4m3 [R, C]
    scales: torch.Tensor  # float32 [R]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def check_fp8_support(device: torch.device, setting: str) -> None:
    """ValueError naming `setting` where a CUDA GPU has no FP8 (e4m3) support: compute capability below 8.9."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"{setting} needs FP8 support (compute capability 8.9 or newer: Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], float32 scales [R]) with x ≈ q * scale[:, None]; a row of zeros gets scale 1."""
    amax = x.abs().amax(dim=-1).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def head_scales(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> float32 [H]: each head's largest magnitude over 448 (1 for a head of zeros), in one read."""
    if x.numel() == 0:  # (an empty max has no value)
        return torch.ones(x.shape[1], device=x.device)
    amax = torch.linalg.vector_norm(x, float("inf"), dim=(0, 2)).float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (e4m3 [T, H, D], float32 scales [H]): one scale per head, over all of its tokens (FP8
    attention's Q, K and V)."""
    scale = head_scales(x)
    return (x.float() / scale[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_heads(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values `quantize_heads` stands for, in `dtype`."""
    return (x.float() * scale[None, :, None]).to(dtype)


def scaled_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                  quantize=quantize_rows) -> torch.Tensor:
    """x [M, K] (16 or 32 bits, or QuantizedRows) @ (e4m3 weight [N, K] * weight_scale [N]).T, x quantized per row
    by `quantize` (this module's, or the Triton kernel's): [M, N] in x's dtype.

    On CUDA the tensor cores' FP8 sums are not promoted to float32 every few steps of K (`use_fast_accum`): as
    Triton's FP8 products do by default on Hopper (the decode kernels here) and vLLM's FP8 matmuls do; what that
    costs against the quantization itself is measured in docs/kernel-notes.md."""
    xq, x_scale = (x.values, x.scales) if isinstance(x, QuantizedRows) else quantize(x)
    if xq.is_cuda and x.dtype == torch.bfloat16:
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scale[:, None], scale_b=weight_scale[None, :].float(),
                                out_dtype=x.dtype, use_fast_accum=True)
    y = (xq.float() @ weight.float().t()) * x_scale[:, None] * weight_scale[None, :].float()
    return y.to(x.dtype)
