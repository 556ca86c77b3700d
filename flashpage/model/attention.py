"""The attention-backend interface the model calls.

The model hands every attention layer flattened tokens of several sequences (varlen, no padding) plus one
`AttentionMetadata` describing the batch. The backend writes the new keys/values into the layer's paged KV
cache (if there is one), then attends each sequence's queries to all its keys. A layer's cache is a pair of
tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.

`AttentionBackend` takes its operations from a module with `flash_attn_varlen`, `paged_attention` and
`reshape_and_cache`: `flashpage.kernels.reference` (PyTorch) or `flashpage.kernels.triton_ops` (Triton).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: query tokens of sequence i are rows cu[i]:cu[i+1]
    seq_lens_k: torch.Tensor  # [B] int32: keys per sequence, cached ones included; queries are the last
    max_seqlen_q: int
    slot_mapping: torch.Tensor | None = None  # [T] int64 cache slot (block * block_size + offset) per new token
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32

    @classmethod
    def prefill(cls, seq_lens: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata for whole sequences with no cache (keys are the queries)."""
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seq_lens, dtype=torch.int32).cumsum(0)
        return cls(cu.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), max(seq_lens, default=0))


BACKENDS = {"torch": "flashpage.kernels.reference", "triton": "flashpage.kernels.triton_ops"}


class AttentionBackend:
    def __init__(self, name: str = "torch"):
        if name not in BACKENDS:
            raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
        self.name = name
        self.ops = importlib.import_module(BACKENDS[name])

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None):
        """q [T, Hq, D], k/v [T, Hkv, D] (new tokens); returns [T, Hq, D]."""
        # transformers' sliding window of W keys counts the query itself: W - 1 to the left.
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        if kv_cache is None:
            return self.ops.flash_attn_varlen(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q,
                                              meta.max_seqlen_q, causal=True, softmax_scale=scale, window_size=window)
        k_cache, v_cache = kv_cache
        self.ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.ops.paged_attention(q, k_cache, v_cache, meta.block_table, meta.cu_seqlens_q, meta.seq_lens_k,
                                        meta.max_seqlen_q, causal=True, softmax_scale=scale, window_size=window)
