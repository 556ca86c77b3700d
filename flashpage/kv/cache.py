"""KVCache: one layer's paged key/value cache, made by one factory and handed whole to the attention kernels.

A cache is blocks of `block_size` token slots: `k` and `v` are `[num_blocks, block_size, num_kv_heads, head_dim]`
in the layout the kernels read (NHD within a block). Its storage dtype and scales live here, so a quantized cache
(FP8 / INT8 with per-head scales) changes this factory and the kernels that read and write it, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # dequantisation scales of a quantized cache; None in the model's dtype
    v_scale: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [KVCache(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]
