"""FlashInfer as a peer of the attention benchmark (`flashpage bench kernels`), when it is importable; never a
dependency of flashpage. Each function plans a FlashInfer wrapper for one shape and returns the call to time.

Its prefill runs with `backend="fa3"` (FlashAttention-3's Hopper kernels) or `"fa2"`; its decode is
`BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`. It compiles its kernels with the machine's nvcc on
first use (about a minute for all of these).
"""

from __future__ import annotations

import torch

WORKSPACE_BYTES = 256 << 20


def available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or present but unusable here: the peer is left out either way
        return False
    return True


def _workspace(device) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _paged_layout(block_table: torch.Tensor, seq_lens: torch.Tensor, page: int):
    """FlashInfer's description of a paged cache: pages per sequence (indptr), their ids, the last one's fill."""
    pages = (seq_lens + page - 1) // page
    indptr = torch.nn.functional.pad(pages.cumsum(0), (1, 0)).to(torch.int32)
    indices = torch.cat([block_table[i, :n] for i, n in enumerate(pages.tolist())]).to(torch.int32)
    last = (seq_lens - (pages - 1) * page).to(torch.int32)
    return indptr, indices, last


def ragged_prefill(q, k, v, cu_seqlens, backend: str, causal: bool = True):
    """Packed sequences: q [T, Hq, D], k/v [T, Hkv, D], the same cu_seqlens for queries and keys."""
    import flashinfer

    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace(q.device), "NHD", backend=backend)
    wrapper.plan(cu_seqlens, cu_seqlens, q.shape[1], k.shape[1], q.shape[2], causal=causal, q_data_type=q.dtype)
    return lambda: wrapper.run(q, k, v)


def paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, backend: str, causal: bool = True):
    """Queries are the last q_len tokens of sequences in a paged cache [blocks, page, Hkv, D] (NHD)."""
    import flashinfer

    page = k_cache.shape[1]
    indptr, indices, last = _paged_layout(block_table, seq_lens, page)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(q.device), "NHD", backend=backend)
    wrapper.plan(cu_seqlens_q, indptr, indices, last, q.shape[1], k_cache.shape[2], q.shape[2], page, causal=causal,
                 q_data_type=q.dtype)
    return lambda: wrapper.run(q, (k_cache, v_cache))


def decode(q, k_cache, v_cache, block_table, seq_lens, tensor_cores: bool = True):
    """One query token per sequence, q [B, Hq, D], over a paged cache [blocks, page, Hkv, D] (NHD) in q's dtype or
    in e4m3 (read with scale 1). `tensor_cores=False`: its CUDA-core decode kernel."""
    import flashinfer

    page = k_cache.shape[1]
    indptr, indices, last = _paged_layout(block_table, seq_lens, page)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(q.device), "NHD",
                                                            use_tensor_cores=tensor_cores)
    wrapper.plan(indptr, indices, last, q.shape[1], k_cache.shape[2], q.shape[2], page, q_data_type=q.dtype,
                 kv_data_type=k_cache.dtype)
    return lambda: wrapper.run(q, (k_cache, v_cache))
