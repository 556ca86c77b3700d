"""The attention-backend interface the model calls, and its plain-PyTorch implementation.

The model hands every attention layer flattened tokens of several sequences (varlen, no padding)
plus one `AttentionMetadata` describing the batch. A backend writes the new keys/values into the
layer's KV cache (if there is one) and attends each sequence's queries to all its keys. The KV cache
of a layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`; a contiguous
per-request cache is the special case of one block per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


class TorchAttentionBackend:
    """Reference backend: gather each sequence's keys through its block table, then SDPA."""

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None):
        """q [T, Hq, D], k/v [T, Hkv, D] (new tokens); returns [T, Hq, D]."""
        if kv_cache is not None:
            k_cache, v_cache = kv_cache
            k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping] = k
            v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping] = v
        out = torch.empty_like(q)
        cu_q = meta.cu_seqlens_q.tolist()
        lens_k = meta.seq_lens_k.tolist()
        for i, len_k in enumerate(lens_k):
            q0, q1 = cu_q[i], cu_q[i + 1]
            if q1 == q0:
                continue
            if kv_cache is None:
                ks, vs = k[q0:q1], v[q0:q1]
            else:
                block_size = k_cache.shape[1]
                blocks = meta.block_table[i, : -(-len_k // block_size)].long()
                ks = k_cache[blocks].flatten(0, 1)[:len_k]
                vs = v_cache[blocks].flatten(0, 1)[:len_k]
            mask = causal_mask(q1 - q0, len_k, sliding_window, q.device)
            o = F.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                attn_mask=mask, scale=scale, enable_gqa=True,
            )
            out[q0:q1] = o.transpose(0, 1)
        return out


def causal_mask(len_q: int, len_k: int, sliding_window: int | None, device) -> torch.Tensor:
    """Boolean [len_q, len_k] mask; queries are the last len_q of len_k positions (bottom-right aligned).

    With a sliding window W a query sees the W most recent keys, itself included (transformers' rule).
    """
    q_pos = torch.arange(len_k - len_q, len_k, device=device)[:, None]
    k_pos = torch.arange(len_k, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask
