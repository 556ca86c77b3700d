"""KVCache: one layer's paged key/value cache, made by one factory and handed whole to the attention kernels.

A cache is blocks of `block_size` token slots: `k` and `v` are `[num_blocks, block_size, num_kv_heads, head_dim]`
in the layout the kernels read (NHD within a block). Its storage dtype and scales live here:
- the model's dtype (`kv_cache_dtype="auto"`): no scales;
- FP8 (e4m3): one float32 scale per KV head, `k_scale`/`v_scale` [num_kv_heads], value = stored * scale; 1.0
  unless the checkpoint gives them (vLLM's `self_attn.k_scale`/`v_scale`); values past +-448 * scale saturate;
- INT8: one float32 scale per token and KV head, `k_scale`/`v_scale` [num_blocks, num_kv_heads, block_size] (a
  page's scales of one head side by side, as the decode reads them), chosen as each token is written: its largest
  magnitude over the head / 127 (symmetric, round to nearest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


@dataclass
class KVCache:
    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # dequantisation scales of a quantized cache (above); None in the model's dtype
    v_scale: torch.Tensor | None = None

    def __post_init__(self):
        if self.k.dtype in KV_CACHE_DTYPES.values():
            blocks, page, heads, _ = self.k.shape
            want = (blocks, heads, page) if self.scaled_per_token else (heads,)
            for scale in (self.k_scale, self.v_scale):
                if scale is None or scale.shape != want or scale.dtype != torch.float32 or not scale.is_contiguous():
                    raise ValueError(f"a {self.k.dtype} cache needs contiguous float32 scales of shape {tuple(want)}")

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def scaled_per_token(self) -> bool:
        """INT8: each slot has its own scales, which move with its block (copy-on-write copies them)."""
        return self.k.dtype == torch.int8

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Blocks src -> dst (copy-on-write), an INT8 cache's scales along; as bytes (CUDA indexes no FP8 tensor)."""
        per_slot = (self.k_scale, self.v_scale) if self.scaled_per_token else ()
        for c in (self.k.view(torch.uint8), self.v.view(torch.uint8), *per_slot):
            c[dst] = c[src]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Token slots (block * block_size + offset) src -> dst, an INT8 cache's scales along."""
        for c in (self.k.view(torch.uint8), self.v.view(torch.uint8)):
            flat = c.view(-1, *c.shape[2:])
            flat[dst] = flat[src]
        if self.scaled_per_token:  # [blocks, heads, block_size]
            page = self.block_size
            for s in (self.k_scale, self.v_scale):
                s[dst // page, :, dst % page] = s[src // page, :, src % page]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V (with an INT8 cache's per-token scales)."""
    scales = 4 if dtype == torch.int8 else 0
    return 2 * num_layers * block_size * num_kv_heads * (head_dim * dtype.itemsize + scales)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def scales():
        if dtype == torch.int8:
            return torch.empty(num_blocks, num_kv_heads, block_size, dtype=torch.float32, device=device)
        if dtype == torch.float8_e4m3fn:
            return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
        return None

    return [KVCache(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device),
                    scales(), scales()) for _ in range(num_layers)]
