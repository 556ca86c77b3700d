"""Plain-PyTorch references of the kernels, same signatures. Also the CPU attention backend's implementation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_mask(len_q: int, len_k: int, causal: bool, window_size, device) -> torch.Tensor | None:
    """Boolean [len_q, len_k]; queries are the last len_q of len_k positions (bottom-right aligned)."""
    left, right = window_size
    if not causal and left < 0 and right < 0:
        return None
    q_pos = torch.arange(len_k - len_q, len_k, device=device)[:, None]
    k_pos = torch.arange(len_k, device=device)[None, :]
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if causal:
        mask &= k_pos <= q_pos
    if right >= 0:
        mask &= k_pos <= q_pos + right
    if left >= 0:
        mask &= k_pos >= q_pos - left
    return mask


def _attend(q, k, v, causal, softmax_scale, window_size):
    """One sequence: q [Lq, Hq, D], k/v [Lk, Hkv, D]."""
    mask = attention_mask(q.shape[0], k.shape[0], causal, window_size, q.device)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=softmax_scale, enable_gqa=True)
    return out.transpose(0, 1)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=True,
                      softmax_scale=None, window_size=(-1, -1), out=None):
    out = torch.empty_like(q) if out is None else out
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        if cu_q[i + 1] > cu_q[i]:
            out[cu_q[i]:cu_q[i + 1]] = _attend(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]],
                                               causal, softmax_scale, window_size)
    return out


def paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, *, causal=True,
                    softmax_scale=None, window_size=(-1, -1), num_splits=None, out=None):
    out = torch.empty_like(q) if out is None else out
    cu_q, lens_k = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    page = k_cache.shape[1]
    for i, len_k in enumerate(lens_k):
        if cu_q[i + 1] == cu_q[i]:
            continue
        blocks = block_table[i, : -(-len_k // page)].long()
        k = k_cache[blocks].flatten(0, 1)[:len_k]
        v = v_cache[blocks].flatten(0, 1)[:len_k]
        out[cu_q[i]:cu_q[i + 1]] = _attend(q[cu_q[i]:cu_q[i + 1]], k, v, causal, softmax_scale, window_size)
    return out


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]
