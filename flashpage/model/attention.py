"""Attention as the model calls it: rotary embedding, the paged KV cache, and the attention kernels.

The model hands every attention layer flattened tokens of several sequences (varlen, no padding) plus one
`AttentionMetadata` describing the batch. With a cache (the layer's `KVCache`), the rotated keys and the values are
written into it and each sequence's queries attend to all its keys there; without one (a plain forward pass) the
queries attend to the new keys. `ops` is a kernel set (`flashpage.kernels.kernel_set`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpage.kernels.block_sparse import choose_blocks
from flashpage.kv import KVCache


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: query tokens of sequence i are rows cu[i]:cu[i+1]
    seq_lens_k: torch.Tensor  # [B] int32: keys per sequence, cached ones included
    max_seqlen_q: int
    positions: torch.Tensor  # [T] int64: each token's position in its sequence (RoPE; the cache slot was made from it)
    slot_mapping: torch.Tensor | None = None  # [T] int64 cache slot (block * block_size + offset) per new token
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32
    # [T] int64: per query, the bits of its sequence's queries it sees, when they form a token tree
    # (`flashpage.kernels.tree`; positions then give each node's depth); None: causal.
    query_mask: torch.Tensor | None = None
    # Sparse attention (a `flashpage.engine.sparse.SparseAttentionConfig`): SparQ for the sequences that decode one
    # token (and the prompt's tokens with `prompt`), over a cache allocated with its extras (sparq=True).
    sparse: object | None = None
    # A block-sparse pattern's view of the batch (`BlockSparsePattern.split`): the paged metadata under which plain
    # causal attention is the pattern's, each block of a prompt chunk's queries a sequence of its own.
    block_sparse: AttentionMetadata | None = None
    # In that view, the key blocks each layer chooses per KV head (`flashpage.kernels.block_sparse.BlockChoice`)
    block_choice: object | None = None
    # A step whose first sequences decode one token each while the others prefill (`DecodeSplit`)
    decode_split: DecodeSplit | None = None

    @classmethod
    def prefill(cls, seq_lens: list[int], device: torch.device | str = "cpu",
                positions: torch.Tensor | None = None) -> "AttentionMetadata":
        """Metadata for whole sequences with no cache (keys are the queries), at positions 0.. unless given."""
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seq_lens, dtype=torch.int32).cumsum(0)
        if positions is None:
            positions = torch.cat([torch.arange(n) for n in seq_lens]) if seq_lens else torch.zeros(0, dtype=torch.int64)
        return cls(cu.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), max(seq_lens, default=0),
                   positions.to(device))


@dataclass
class DecodeSplit:
    """A mixed step's two halves, attended apart: the first `rows` sequences decode one query each (the scheduler
    puts running sequences first, oldest first, so decoding ones lead), the rest prefill. In one call the decoding
    rows would ride in the prefill kernel's query tiles, four rows of a 128-row tile under GQA 4, each such item a
    short chain of key tiles: in the offline run's mixed steps (some 450 decoding rows beside 15k prompt tokens)
    that took 1.0 ms a layer in bf16 and 1.4 ms over an FP8 cache, where the decode kernel reads the same keys in
    a fraction of it (docs/kernel-notes.md)."""
    rows: int
    decode: AttentionMetadata  # rows [0, rows): one query per sequence
    rest: AttentionMetadata  # rows [rows, T), cu_seqlens_q counted from 0


def attention(ops, q, k, v, cos, sin, kv_cache: KVCache | None, meta: AttentionMetadata, scale: float,
              sliding_window: int | None):
    """q [T, Hq, D], k/v [T, Hkv, D] (new tokens, before rotary embedding); returns [T, Hq, D]."""
    # transformers' sliding window of W keys counts the query itself: W - 1 to the left.
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    if kv_cache is None:
        if meta.query_mask is not None:
            raise ValueError("a token tree (query_mask) is attended through the KV cache")
        q, k = ops.rope_and_cache(q, k, cos, sin)
        return ops.flash_attn_varlen(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q,
                                     meta.max_seqlen_q, causal=True, softmax_scale=scale, window_size=window)
    q, k = ops.rope_and_cache(q, k, cos, sin, v, kv_cache, meta.slot_mapping)
    if kv_cache.k_t is not None:
        ops.write_sparq_copies(k, kv_cache, meta.slot_mapping, meta.block_table, meta.cu_seqlens_q, meta.seq_lens_k)
    sparse = meta.sparse if meta.sparse is not None and meta.sparse.method == "sparq" else None
    split = meta.decode_split
    if split is None:
        return _attend(ops, q, kv_cache, meta, sparse, scale, window, torch.empty_like(q))
    out = torch.empty_like(q)
    n = split.rows
    # (one program per decoding sequence and KV head, as the prefill kernel gave each: a mixed step's time is its
    # prefill's, and a split count chosen per step would compile a decode kernel for each count it meets)
    _attend(ops, q[:n], kv_cache, split.decode, sparse, scale, window, out[:n], num_splits=1)
    _attend(ops, q[n:], kv_cache, split.rest, sparse, scale, window, out[n:])
    return out


def _attend(ops, q, kv_cache: KVCache, meta: AttentionMetadata, sparse, scale: float, window, out,
            num_splits: int | None = None):
    """Attention of queries whose keys are cached (written already) into `out`: SparQ for decoding rows (and
    prompts with `sparse.prompt`) where `sparse` is given, else the paged kernels (through a block-sparse view
    where the step has one; `num_splits`: the decode's, else its own choice)."""
    if sparse is not None and (sparse.prompt or meta.max_seqlen_q == 1):
        return ops.sparq_attention(q, kv_cache, meta.block_table, meta.cu_seqlens_q, meta.seq_lens_k,
                                   meta.max_seqlen_q, r=sparse.r, k=sparse.k, recent=sparse.recent,
                                   softmax_scale=scale, out=out)
    view = meta.block_sparse if meta.block_sparse is not None else meta
    table = view.block_table
    if view.block_choice is not None:  # this layer's keys are cached: choose each KV head's blocks from them
        table = choose_blocks(ops, q, kv_cache, meta.block_table, table, view.block_choice, scale)
    out = ops.paged_attention(q, kv_cache, table, view.cu_seqlens_q, view.seq_lens_k, view.max_seqlen_q,
                              causal=True, softmax_scale=scale, window_size=window, num_splits=num_splits,
                              query_mask=meta.query_mask, out=out)
    if sparse is not None:  # prefilling and decoding sequences in one call: SparQ for the decoding ones
        cu = meta.cu_seqlens_q
        decoding = ((cu[1:] - cu[:-1]) == 1).nonzero()[:, 0]
        if decoding.numel():
            rows = cu[decoding].long()
            out[rows] = ops.sparq_attention(q[rows], kv_cache, meta.block_table[decoding],
                                            torch.arange(decoding.numel() + 1, dtype=cu.dtype, device=cu.device),
                                            meta.seq_lens_k[decoding], 1, r=sparse.r, k=sparse.k,
                                            recent=sparse.recent, softmax_scale=scale)
    return out
