"""The CPU kernel set: the PyTorch references (same signatures), except where a batched form is measurably faster
on a CPU. Decode attention is one scaled-dot-product call per group of sequences of the same page count instead
of one call per sequence (at 32 sequences that call count was most of a CPU decode step), its gather indices and
masks computed once a step, not once a layer; the cache write skips the reference's selection. Products read
bfloat16 weights packed for oneDNN, and GGUF's 4-bit codes as stored or, from a few rows on, dequantized once;
token trees attend to the keys before them without a mask (docs/cpu.md)."""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from flashpage.kernels import reference
from flashpage.kernels.int4 import int4_linear
from flashpage.kernels.tree import check_query_mask, tree_visible
from flashpage.kernels.reference import (apply_penalties, apply_token_bitmask, block_mass, composed_linear,
                                         flash_attn_varlen, greedy, sample, silu_and_mul, sparq_attention,
                                         top_k_positions, write_sparq_copies)

__all__ = ["apply_penalties", "apply_token_bitmask", "block_mass", "flash_attn_varlen", "greedy", "linear",
           "paged_attention", "reshape_and_cache", "rms_norm", "rope_and_cache", "sample", "silu_and_mul",
           "sparq_attention", "top_k_positions", "write_sparq_copies"]


def rms_norm(x, weight, eps):
    """torch's own RMSNorm: one operator instead of the reference's five."""
    return F.rms_norm(x, weight.shape, weight, eps)


def linear(x, weight, bias=None, *, norm_weight=None, eps=0.0, silu_mul=False, residual=None, out_dtype=None,
           weight_scale=None, out=None, quantized_output=False):
    """The reference's composition with packed products. GGUF's 4-bit codes (a uint8 weight) multiply as stored
    below INT4_ROWS rows, where a product streams the weights; from there on the 4-bit kernel is compute-bound and
    slower than bfloat16, so the codes are dequantized once into a kept copy in the model's dtype (docs/cpu.md)."""
    if weight.dtype == torch.uint8 and x.shape[0] >= INT4_ROWS:
        dtype = x.dtype
        weight = _kept(weight, f"dequantized {dtype}", lambda w: dequantize_int4(w, weight_scale).to(dtype))
        weight_scale = None
    return composed_linear(rms_norm, silu_and_mul, x, weight, bias, norm_weight, eps, silu_mul, residual, out_dtype,
                           weight_scale, product=packed_product, out=out)


INT4_ROWS = 8  # one model's 4-bit products took 3.1 ms at 1 row, 10.1 at 8 and 20.0 at 16; bfloat16 packed ~10.3


def dequantize_int4(packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The bfloat16 weight [N, K] that `int4_linear` multiplies by: the kernel's own product with the identity."""
    return int4_linear(torch.eye(packed.shape[1] * 2, dtype=torch.bfloat16), packed, scales_zeros).t().contiguous()


# (id(weight), kind) -> (a weak reference to the weight, its version when derived, what was derived from it)
_derived: dict[tuple[int, str], tuple[weakref.ref, int, torch.Tensor]] = {}


def _kept(weight: torch.Tensor, kind: str, derive) -> torch.Tensor:
    """derive(weight), computed on first use and kept while the weight lives, again when it has been written (a
    tensor made in inference mode, a weight derived here, counts no versions)."""
    key, version = (id(weight), kind), 0 if weight.is_inference() else weight._version
    entry = _derived.get(key)
    if entry is None or entry[0]() is not weight or entry[1] != version:
        entry = (weakref.ref(weight, lambda _: _derived.pop(key, None)), version, derive(weight.detach()))
        _derived[key] = entry
    return entry[2]


@functools.cache
def _onednn_bfloat16() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); on others (an AVX2-only
    CPU) its weight reorder raises."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed_product(x, weight, bias, residual):
    """x @ weight.T + bias + residual, a bfloat16 weight in oneDNN's blocked layout, kept beside it (1.2-1.5x
    faster products, docs/cpu.md), where oneDNN takes bfloat16. Float32 stays plain: MKL's packed layout was 1.3x
    faster at 32 rows, but its results then depend on the number of rows, so a verify step would no longer give the
    tokens decoding gives."""
    if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or not _onednn_bfloat16():
        return reference.dense_product(x, weight, bias, residual)
    packed = _kept(weight, "packed", torch.ops.mkldnn._reorder_linear_weight)
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y if residual is None else y + residual  # (oneDNN's fused add: slower at one row, 33 against 22 us)


def paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, *, causal=True,
                    softmax_scale=None, window_size=(-1, -1), num_splits=None, out=None, query_mask=None):
    """Decode: one call per sequence, over the keys it sees, gathered by slot. One at a time keeps each result
    independent of what else is batched, so a seeded request samples the same tokens in any batch: PyTorch's CPU
    flash kernel, given several sequences and two threads or more, computes one sequence's result differently
    depending on the others (torch 2.13), and a batched matmul's result depends on the batch's size too."""
    batch = block_table.shape[0]
    if query_mask is not None and q.device.type == "cpu":
        check_query_mask(query_mask, q, causal, window_size)
        return tree_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, query_mask, softmax_scale, out)
    if max_seqlen_q != 1 or q.shape[0] != batch or query_mask is not None or block_table.dim() == 3:
        # prefill, trees, a block table per KV head: as the reference
        return reference.paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q,
                                         causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                         out=out, query_mask=query_mask)
    out = torch.empty_like(q) if out is None else out
    for i, slots in enumerate(_decode_slots(block_table, seq_lens_k, kv_cache.block_size, window_size[0])):
        k, v = (x.transpose(0, 1)[None] for x in read_slots(kv_cache, slots, q.dtype))  # [1, Hkv, L, D]
        out[i] = F.scaled_dot_product_attention(q[i, None, :, None, :], k, v, scale=softmax_scale,
                                                enable_gqa=True)[0, :, 0]
    return out


def tree_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, query_mask, softmax_scale, out=None):
    """A step whose queries form token trees (`kernels/tree.py`), one sequence at a time: its queries see every key
    before the tree, densely (PyTorch's flash kernel, no mask, which also returns the log-sum-exp), and among the
    tree's own keys their ancestors (a masked product of the tree's few rows), the two merged by their log-sum-exps.
    A GQA group's query heads go in as rows of their KV head, so no key is copied per query head, and the masks
    are made once a step, not once a layer. PyTorch's masked call over all the keys takes 5x its unmasked one;
    30 queries over 300-700 keys take 0.33-0.50 ms a layer here, 0.53-0.71 in the first version (docs/cpu.md)."""
    cu_q, lens_k, visible = _tree_masks(cu_seqlens_q, seq_lens_k, query_mask)
    if any(len_k < cu_q[i + 1] - cu_q[i] for i, len_k in enumerate(lens_k)):
        # rows of padding that have no key (a CUDA graph's inputs, run eagerly in a test): as the reference does
        return reference.paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, 0,
                                         softmax_scale=softmax_scale, out=out, query_mask=query_mask)
    out = torch.empty_like(q) if out is None else out
    heads, dim = q.shape[1:]
    scale = softmax_scale or dim ** -0.5
    page = kv_cache.block_size
    for i, len_k in enumerate(lens_k):
        first, end = cu_q[i], cu_q[i + 1]
        n, prefix = end - first, len_k - (end - first)
        if n == 0:
            continue
        k, v = (x.flatten(0, 1)[:len_k].transpose(0, 1) for x in
                reference.read_pages(kv_cache, block_table[i, :-(-len_k // page)], q.dtype))  # [Hkv, len_k, D]
        kv_heads = k.shape[0]
        qs = q[first:end].transpose(0, 1).reshape(kv_heads, heads // kv_heads * n, dim)  # rows (head of group, query)
        scores = (qs.float() @ k[:, prefix:].float().transpose(1, 2)) * scale  # [Hkv, group x n, n]
        scores.view(kv_heads, -1, n, n).masked_fill_(~visible[i], float("-inf"))
        lse = scores.logsumexp(-1, keepdim=True)  # (a query always sees itself)
        o = (scores - lse).exp_() @ v[:, prefix:].float()
        if prefix > 0:
            o_pre, lse_pre = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qs[None], k[None, :, :prefix], v[None, :, :prefix], scale=scale)[:2]
            o = torch.lerp(o_pre[0].float(), o, torch.sigmoid(lse - lse_pre[0, ..., None]))  # the two, by mass
        out[first:end] = o.view(heads, n, dim).transpose(0, 1)
    return out


_last_tree: tuple | None = None  # (a step's query starts, key lengths, query mask, what _tree_masks returned)


def _tree_masks(cu_seqlens_q, seq_lens_k, query_mask):
    """(query starts, key lengths, and per sequence which of its tree's keys each query sees [n, n]), kept for
    the next call with equal inputs: every layer of a step asks the same."""
    global _last_tree
    memo = _last_tree
    if memo is not None and torch.equal(memo[0], cu_seqlens_q) and torch.equal(memo[1], seq_lens_k) and \
            torch.equal(memo[2], query_mask):
        return memo[3]
    cu_q, lens_k = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    visible = []
    for i in range(len(lens_k)):
        n = cu_q[i + 1] - cu_q[i]
        visible.append(tree_visible(query_mask[cu_q[i]:cu_q[i + 1]], n) & torch.ones(n, n, dtype=torch.bool).tril_())
    _last_tree = (cu_seqlens_q.clone(), seq_lens_k.clone(), query_mask.clone(), (cu_q, lens_k, visible))
    return _last_tree[3]


_last_slots: tuple | None = None  # (a step's block table, its lengths, page, window, what _decode_slots returned)


def _decode_slots(block_table, seq_lens_k, page: int, window: int) -> list[torch.Tensor]:
    """Each sequence's cache slots of the keys its decode query sees. Every layer of a step asks with the same
    block table and lengths, so the last call's answer is kept and reused for an equal table and lengths:
    computing it took most of a one-sequence attention call."""
    global _last_slots
    memo = _last_slots
    if memo is not None and memo[2:4] == (page, window) and torch.equal(memo[1], seq_lens_k) and \
            torch.equal(memo[0], block_table):
        return memo[4]
    offsets = torch.arange(page)
    slots = []
    for table, length in zip(block_table.long(), seq_lens_k.tolist()):
        first = max(0, length - 1 - window) if window >= 0 else 0
        pages = table[first // page:-(-length // page)]
        slots.append((pages[:, None] * page + offsets).flatten()[first % page:first % page + length - first])
    _last_slots = (block_table.clone(), seq_lens_k.clone(), page, window, slots)
    return slots


def read_slots(kv_cache, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values at cache slots [...] as `dtype` [..., Hkv, D], dequantized."""
    def gather(x):  # (index_select on a flat index: half the time of indexing by slots [G, L] here)
        return x.reshape(-1, *x.shape[2:]).index_select(0, slots.flatten()).view(*slots.shape, *x.shape[2:])

    k, v = gather(kv_cache.k).to(dtype), gather(kv_cache.v).to(dtype)
    if kv_cache.k_scale is None:
        return k, v
    if kv_cache.scaled_per_token:  # INT8: [blocks, Hkv, block_size] scales
        block, offset = slots // kv_cache.block_size, slots % kv_cache.block_size
        return tuple(x * s[block, :, offset][..., None].to(dtype)
                     for x, s in ((k, kv_cache.k_scale), (v, kv_cache.v_scale)))
    return k * kv_cache.k_scale[:, None].to(dtype), v * kv_cache.v_scale[:, None].to(dtype)  # FP8: per KV head


def reshape_and_cache(k, v, kv_cache, slot_mapping) -> None:
    """The reference's, without its selection of the written tokens where every token is written."""
    if kv_cache.k_scale is not None or bool((slot_mapping < 0).any()):
        return reference.reshape_and_cache(k, v, kv_cache, slot_mapping)
    slots = slot_mapping.long()
    for x, cache in ((k, kv_cache.k), (v, kv_cache.v)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))


def rope_and_cache(q, k, cos, sin, v=None, kv_cache=None, slot_mapping=None):
    q, k = reference.rotate_half_rope(q, cos, sin), reference.rotate_half_rope(k, cos, sin)
    if kv_cache is not None:
        if kv_cache.keys_rotated:
            q, k = reference.rotate_keys(q), reference.rotate_keys(k)
        reshape_and_cache(k, v, kv_cache, slot_mapping)
    return q, k
