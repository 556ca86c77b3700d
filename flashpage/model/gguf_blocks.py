"""A GGUF file's 4-bit weights kept as they are stored (`quantization="gguf"`, CPU).

llama.cpp's Q4_0 and Q4_1 store each run of 32 weights of a row as 4-bit codes q (0..15) with one float16 scale d
(Q4_1: and a minimum m): w = d * (q - 8) (Q4_0) or w = d * q + m (Q4_1). Both are w = (q - 8) * scale + zero,
PyTorch's int4 group-wise form (zero = 0, or m + 8 d), so the decoder layers' projections keep the file's codes,
packed by `torch._convert_weight_to_int4pack_for_cpu`, and multiply through `torch._weight_int4pack_mm_for_cpu`
(`flashpage.kernels.int4`). A token then streams an eighth of the bytes of float32 weights. That kernel is fast
only with bfloat16 activations, scales and zeros, so those are rounded to bfloat16 at each product (the float16
scales lose 3 bits); the embedding, the LM head, the norms and everything between the products stay in the
model's dtype. The quality cost is measured in README (`flashpage bench quality`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

GROUP = 32  # weights per block in Q4_0 / Q4_1
KEPT_TYPES = ("Q4_0", "Q4_1")


def use_int4_weights(model: nn.Module) -> None:
    """Give each projection of the decoder layers (on the meta device, before the model is allocated) a uint8
    weight [N, K] for the codes as they load and a float32 `weight_scale` [N, K / 32, 2] for (scale, zero)."""
    for module in model.layers.modules():
        if isinstance(module, nn.Linear):
            n, k = module.weight.shape
            if k % GROUP or n % 16:  # (the packing's requirement on N)
                raise ValueError(f"quantization 'gguf' needs projections of K a multiple of {GROUP} and N of 16; "
                                 f"this model has one of {n} x {k}")
            device = module.weight.device
            module.weight = nn.Parameter(torch.empty(n, k, dtype=torch.uint8, device=device), requires_grad=False)
            module.weight_scale = nn.Parameter(torch.empty(n, k // GROUP, 2, device=device), requires_grad=False)


def pack_int4_weights(model: nn.Module) -> None:
    """After loading: codes into the CPU kernel's packed layout [N, K / 2], (scale, zero) into [K / 32, N, 2]
    bfloat16, as `torch._weight_int4pack_mm_for_cpu` reads them."""
    for module in model.layers.modules():
        if isinstance(module, nn.Linear):
            packed = torch._convert_weight_to_int4pack_for_cpu(module.weight.data.int(), 1)
            module.weight = nn.Parameter(packed, requires_grad=False)
            module.weight_scale = nn.Parameter(module.weight_scale.data.transpose(0, 1).to(torch.bfloat16)
                                               .contiguous(), requires_grad=False)


def unpack_blocks(raw: np.ndarray, quant_type: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 tensor's bytes ([N, bytes per row], as gguf reads them) as codes uint8 [N, K] and
    (scale, zero) float32 [N, K / 32, 2] with w = (q - 8) * scale + zero."""
    n, k = shape
    header = 2 if quant_type == "Q4_0" else 4  # d, or d and m, float16 each
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, header + GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    zero = np.zeros_like(d) if quant_type == "Q4_0" else blocks[..., 2:4].copy().view(np.float16)[..., 0] + 8 * d
    nibbles = blocks[..., header:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # a block's low nibbles are its first 16
    return codes.reshape(n, k), np.stack([d, zero.astype(np.float32)], axis=-1)
