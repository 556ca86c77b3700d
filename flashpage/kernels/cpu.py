"""The CPU kernel set: the PyTorch references (same signatures), except where a batched form is measurably faster
on a CPU. Decode attention is one scaled-dot-product call per group of sequences of the same page count instead
of one call per sequence: at 32 sequences that call count was most of a CPU decode step (docs/cpu.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashpage.kernels import reference
from flashpage.kernels.reference import (apply_penalties, apply_token_bitmask, composed_linear, flash_attn_varlen,
                                         greedy, reshape_and_cache, rope_and_cache, sample, silu_and_mul,
                                         sparq_attention, write_sparq_copies)

__all__ = ["apply_penalties", "apply_token_bitmask", "flash_attn_varlen", "greedy", "linear", "paged_attention",
           "reshape_and_cache", "rms_norm", "rope_and_cache", "sample", "silu_and_mul", "sparq_attention",
           "write_sparq_copies"]


def rms_norm(x, weight, eps):
    """torch's own RMSNorm: one operator instead of the reference's five."""
    return F.rms_norm(x, weight.shape, weight, eps)


def linear(x, weight, bias=None, *, norm_weight=None, eps=0.0, silu_mul=False, residual=None, out_dtype=None,
           weight_scale=None):
    return composed_linear(rms_norm, silu_and_mul, x, weight, bias, norm_weight, eps, silu_mul, residual, out_dtype,
                           weight_scale)


def paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, *, causal=True,
                    softmax_scale=None, window_size=(-1, -1), num_splits=None, out=None, query_mask=None,
                    block_sparse=None):
    """Decode: one call per group of sequences with the same number of pages, keys padded to those pages and the
    padding masked. Grouping by a sequence's own page count keeps each result independent of what else is batched
    (a reduction's order depends on the padded length), so a seeded request samples the same tokens in any batch."""
    batch = block_table.shape[0]
    if max_seqlen_q != 1 or q.shape[0] != batch or query_mask is not None:  # prefill, trees: as the reference
        return reference.paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q,
                                         causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                         out=out, query_mask=query_mask, block_sparse=block_sparse)
    page = kv_cache.k.shape[1]
    lens = seq_lens_k.long()
    num_pages = (lens + page - 1) // page
    out = torch.empty_like(q) if out is None else out
    for n in num_pages.unique().tolist():
        rows = (num_pages == n).nonzero()[:, 0]
        key = torch.arange(n * page)[None, :]
        length = lens[rows, None]
        mask = key < length  # a decode query is its sequence's last position: it sees every key before it
        if window_size[0] >= 0:
            mask &= key >= length - 1 - window_size[0]
        # slots past a sequence's end were never written (NaN, say): zeroed, as a masked weight times NaN is NaN
        k, v = (x.flatten(1, 2).masked_fill(~mask[:, :, None, None], 0).transpose(1, 2)
                for x in reference.read_pages(kv_cache, block_table[rows, :n], q.dtype))
        o = F.scaled_dot_product_attention(q[rows, :, None, :], k, v, attn_mask=mask[:, None, None, :],
                                           scale=softmax_scale, enable_gqa=True)
        out[rows] = o[:, :, 0, :]
    return out
