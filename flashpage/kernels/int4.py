"""Products with 4-bit group-wise weights (`flashpage.model.gguf_blocks`): PyTorch's CPU kernel, which reads the
packed codes and the groups' (scale, zero) and is fast only in bfloat16, so the activations are rounded to it."""

from __future__ import annotations

import torch


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T in x's dtype, W = (q - 8) * scale + zero per group of K; packed [N, K / 2] uint8,
    scales_zeros [K / group, N, 2] bfloat16."""
    group = x.shape[-1] // scales_zeros.shape[0]
    return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group, scales_zeros).to(x.dtype)
