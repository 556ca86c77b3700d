"""The batch-invariant kernel set (the engine's deterministic mode): the Triton kernels, with every reduction done
in an order that does not depend on what else is in the batch, so a request's logits are bit-identical alone and
in any batch, prefilled in one piece or in chunks.

What changes against `triton_ops`, and why:
- linear layers: one Triton kernel for every number of rows, whose sums over K run in one order whatever its
  tiles (cuBLAS picks its algorithm and its split-K by the shape, so a row's sums depend on how many rows came
  with it);
- attention: every call, decode included, runs one tile shape with no split-KV and no copy-engine path (the
  decode kernel's tiles, splits and instructions follow the batch), and masks every key tile (the compiler fuses
  an unmasked tile's arithmetic with one rounding fewer, and which tiles need no mask depends on the rows that
  share a program); a query row's keys are walked in the same BLOCK_N tiles from key 0 whichever rows share its
  program, and tiles a row cannot see add exact zeros;
- sampling: each row cut into a fixed number of chunks (the default follows the batch size), greedy rows too.
RMSNorm, RoPE, the cache write, SiLU-and-mul and the penalties already work row by row.
"""

from __future__ import annotations

import functools

from flashpage.kernels import attention as _attention
from flashpage.kernels import sampling as _sampling
from flashpage.kernels.activation import silu_and_mul
from flashpage.kernels.cache import reshape_and_cache
from flashpage.kernels.linear import invariant_linear
from flashpage.kernels.norm import rms_norm
from flashpage.kernels.rotary import rope_and_cache
from flashpage.kernels.sampling import apply_penalties, apply_token_bitmask

__all__ = ["apply_penalties", "apply_token_bitmask", "flash_attn_varlen", "greedy", "linear", "paged_attention",
           "reshape_and_cache", "rms_norm", "rope_and_cache", "sample", "silu_and_mul"]

SAMPLING_CHUNKS = 16  # pieces per logits row, whatever the batch


def linear(x, weight, bias=None, *, norm_weight=None, eps=0.0, silu_mul=False, residual=None, out_dtype=None,
           weight_scale=None, out=None, quantized_output=False):
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    return invariant_linear(x, weight, bias, silu_mul=silu_mul, residual=residual, out_dtype=out_dtype,
                            weight_scale=weight_scale, out=out)


def paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, *, causal=True,
                    softmax_scale=None, window_size=(-1, -1), num_splits=None, out=None, query_mask=None):
    """(`num_splits` is taken and not used: the batch-invariant decode never splits.)"""
    return _attention.paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, causal=causal,
                                      softmax_scale=softmax_scale, window_size=window_size, batch_invariant=True,
                                      out=out, query_mask=query_mask)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=True,
                      softmax_scale=None, window_size=(-1, -1), out=None):
    return _attention.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                        batch_invariant=True, out=out)


sample = functools.partial(_sampling.sample, chunks=SAMPLING_CHUNKS)


greedy = functools.partial(_sampling.greedy, chunks=SAMPLING_CHUNKS)
