"""The CPU kernel set: the PyTorch references (same signatures), except where a batched form is measurably faster
on a CPU. Decode attention is one scaled-dot-product call over the whole batch (keys gathered from the pages and
padded to the longest sequence, padding masked) instead of one call per sequence: at 32 sequences that call count
was most of a CPU decode step (docs/cpu.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashpage.kernels import reference
from flashpage.kernels.reference import (apply_penalties, composed_linear, flash_attn_varlen, reshape_and_cache,
                                         rope_and_cache, sample, silu_and_mul)

__all__ = ["apply_penalties", "flash_attn_varlen", "linear", "paged_attention", "reshape_and_cache", "rms_norm",
           "rope_and_cache", "sample", "silu_and_mul"]


def rms_norm(x, weight, eps):
    """torch's own RMSNorm: one operator instead of the reference's five."""
    return F.rms_norm(x, weight.shape, weight, eps)


def linear(x, weight, bias=None, *, norm_weight=None, eps=0.0, silu_mul=False, residual=None, out_dtype=None):
    return composed_linear(rms_norm, silu_and_mul, x, weight, bias, norm_weight, eps, silu_mul, residual, out_dtype)


def paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, *, causal=True,
                    softmax_scale=None, window_size=(-1, -1), num_splits=None, out=None):
    batch = block_table.shape[0]
    if max_seqlen_q != 1 or q.shape[0] != batch:  # prefill: as the reference
        return reference.paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q,
                                         causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                         out=out)
    page = kv_cache.k.shape[1]
    lens = seq_lens_k.long()
    longest = int(lens.max())
    blocks = block_table[:, :-(-longest // page)].long()

    def gather(cache):  # [batch, kv heads, longest, head dim]
        return cache[blocks].flatten(1, 2)[:, :longest].transpose(1, 2)

    key = torch.arange(longest)[None, :]
    mask = None
    if batch > 1 or window_size[0] >= 0:
        mask = key < lens[:, None]  # a decode query is its sequence's last position: it sees every key before it
        if window_size[0] >= 0:
            mask &= key >= lens[:, None] - 1 - window_size[0]
        mask = mask[:, None, None, :]
    o = F.scaled_dot_product_attention(q[:, :, None, :], gather(kv_cache.k), gather(kv_cache.v),
                                       attn_mask=mask, scale=softmax_scale, enable_gqa=True)
    o = o[:, :, 0, :]
    if out is None:
        return o
    out.copy_(o)
    return out
