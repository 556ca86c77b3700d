"""Plain-PyTorch references of the kernels, same signatures. Also the CPU attention backend's implementation."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from flashpage.kernels.fp8 import FP8, FP8_MAX, quantize_rows, scaled_linear
from flashpage.kernels.int4 import int4_linear
from flashpage.kernels.tree import check_query_mask, tree_visible

INT8_MAX = 127.0


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


def _attend(q, k, v, causal, softmax_scale, window_size, tree_bits=None):
    """One sequence: q [Lq, Hq, D], k/v [Lk, Hkv, D]; tree_bits [Lq]: its queries form a token tree."""
    mask = attention_mask(q.shape[0], k.shape[0], causal, window_size, q.device)
    if tree_bits is not None:
        mask = mask & tree_visible(tree_bits, k.shape[0])
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


def paged_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, *, causal=True,
                    softmax_scale=None, window_size=(-1, -1), num_splits=None, out=None, query_mask=None):
    if query_mask is not None:
        check_query_mask(query_mask, q, causal, window_size)
    out = torch.empty_like(q) if out is None else out
    cu_q, lens_k = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    page = kv_cache.block_size
    per_head = block_table.dim() == 3  # [sequences, KV heads, pages]: each KV head's own pages
    group = q.shape[1] // kv_cache.k.shape[2]
    for i, len_k in enumerate(lens_k):
        rows = slice(cu_q[i], cu_q[i + 1])
        if rows.start == rows.stop:
            continue
        bits = None if query_mask is None else query_mask[rows]
        for h, table in enumerate(block_table[i] if per_head else block_table[i, None]):
            k, v = (x.flatten(0, 1)[:len_k] for x in read_pages(kv_cache, table[: -(-len_k // page)], q.dtype))
            heads = slice(h * group, (h + 1) * group) if per_head else slice(None)
            if per_head:
                k, v = k[:, h:h + 1], v[:, h:h + 1]
            out[rows, heads] = _attend(q[rows, heads], k, v, causal, softmax_scale, window_size, bits)
    return out


def top_k_positions(values, k, width=None, fill=0, dtype=torch.int32, drop_bits=0):
    """The positions of the k largest of each row of values [..., n], in position order: [..., width] (width = k
    by default), the slots past a row's k set to fill; a k over width takes the width largest. Non-negative floats
    rank as themselves (with drop_bits, as their bits less that many of the lowest), anything below zero under
    them; of equal values the first positions are taken (with drop_bits, ranks stop at the kernels' largest key:
    ranked by an fp16's exponent alone, infinity ties with the largest finite one). k: an int, or a tensor of one
    per row."""
    n = values.shape[-1]
    width = width if width is not None else k
    ks = k if isinstance(k, torch.Tensor) else torch.full(values.shape[:-1], k, device=values.device)
    ranked = values.double()
    if drop_bits:
        bits = values.view({2: torch.int16, 4: torch.int32}[values.element_size()]).long()
        top = 2 ** (8 * values.element_size() - 1 - drop_bits) - 2  # (`topk._key` ranks from 1, 0 below zero)
        ranked = ((bits & (2 ** (8 * values.element_size()) - 1)) >> drop_bits).clamp(max=top).double()
    ranked = torch.where(values >= 0, ranked, -1.0)  # (NaN too goes under)
    order = ranked.sort(dim=-1, descending=True, stable=True).indices[..., :width]
    taken = torch.arange(order.shape[-1], device=values.device) < ks[..., None].clamp(max=n)
    positions = torch.where(taken, order, n).sort(-1).values
    positions = torch.nn.functional.pad(positions, (0, width - positions.shape[-1]), value=n)
    return torch.where(positions == n, fill, positions).to(dtype)


def block_mass(q, kv_cache, block_table, choice, softmax_scale=None):
    """Per query block that chooses key blocks (`choice`: a `block_sparse.BlockChoice`, its rows) and KV head, the
    attention its sampled queries give each candidate block: every `choice.sample`-th of its queries counted back
    from its last, each of the group's heads, softmax over all the sequence's keys up to the query, summed per
    block of `choice.block` keys; with `choice.one_head`, the j-th sampled query in head j % group of the group
    only. float32 [Hkv, R, choice.max_candidates], -inf past a row's candidates."""
    hkv, page = kv_cache.k.shape[2], kv_cache.block_size
    group = q.shape[1] // hkv
    block, sample = choice.block, choice.sample
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.full((hkv, choice.rows.shape[0], choice.max_candidates), float("-inf"), device=q.device)
    for r, (_, seq, q0, n_q, pos0, first, candidates, _) in enumerate(choice.rows.tolist()):
        offsets = torch.arange(n_q - 1, -1, -sample, device=q.device)
        n_keys = pos0 + n_q
        keys = read_pages(kv_cache, block_table[seq, :-(-n_keys // page)], torch.float32)[0].flatten(0, 1)[:n_keys]
        s = torch.einsum("shd,khd->hsk", q[q0 + offsets].float(), keys.repeat_interleave(group, 1)) * scale
        unseen = torch.arange(n_keys, device=q.device) > pos0 + offsets[:, None]
        p = torch.softmax(s.masked_fill(unseen, float("-inf")), -1).view(hkv, group, -1, n_keys)  # [.., S, keys]
        if choice.one_head:  # sample j in head j % group
            sample_head = torch.arange(len(offsets), device=q.device) % group
            p = p * (sample_head == torch.arange(group, device=q.device)[:, None])[None, :, :, None]
        p = p.sum((1, 2))
        out[:, r, :candidates] = p[:, first * block:(first + candidates) * block].view(hkv, candidates, block).sum(-1)
    return out


def read_pages(kv_cache, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of cache blocks [..., n] as `dtype` [..., n, block_size, Hkv, D], dequantized."""
    blocks = blocks.long()
    k, v = kv_cache.k[blocks].to(dtype), kv_cache.v[blocks].to(dtype)
    if kv_cache.k_scale is None:
        return k, v
    if kv_cache.scaled_per_token:  # INT8: [blocks, Hkv, block_size] scales
        return (k * kv_cache.k_scale[blocks].transpose(-1, -2)[..., None].to(dtype),
                v * kv_cache.v_scale[blocks].transpose(-1, -2)[..., None].to(dtype))
    return k * kv_cache.k_scale[:, None].to(dtype), v * kv_cache.v_scale[:, None].to(dtype)  # FP8: per KV head


def reshape_and_cache(k, v, kv_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scale in ((k, kv_cache.k, kv_cache.k_scale), (v, kv_cache.v, kv_cache.v_scale)):
        stored, token_scale = quantize_for_cache(x[keep], cache.dtype, scale)
        cache.view(-1, *cache.shape[2:])[slots] = stored
        if token_scale is not None:
            scale[slots // cache.shape[1], :, slots % cache.shape[1]] = token_scale


def quantize_for_cache(x: torch.Tensor, dtype: torch.dtype, head_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, Hkv, D] as a cache of `dtype` stores it (`flashpage.kv.cache`), and for INT8 its new scales [T, Hkv].
    FP8 divides by the per-head scales and saturates at e4m3's largest value instead of overflowing to NaN; INT8
    scales each (token, head) by its largest magnitude / 127 and rounds to nearest."""
    if dtype == FP8:
        return (x.float() / head_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(dtype), None
    if dtype == torch.int8:
        largest = x.float().abs().amax(-1)
        scale = torch.where(largest > 0, largest / INT8_MAX, 1.0)
        return torch.floor(x.float() / scale[..., None] + 0.5).clamp(-INT8_MAX, INT8_MAX).to(dtype), scale
    return x.to(dtype), None


def rms_norm(x, weight, eps):
    f = x.float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * f.to(x.dtype)


def silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x, weight, bias=None, *, norm_weight=None, eps=0.0, silu_mul=False, residual=None, out_dtype=None,
           weight_scale=None, out=None, quantized_output=False):
    """A projection with its decoder-layer neighbours: [silu_and_mul](norm(x) @ weight.T + bias) + residual.
    With `weight_scale` [N] the weight is FP8 (e4m3), one scale per output feature (`flashpage.kernels.fp8`); with
    a uint8 weight, GGUF's 4-bit codes packed, and `weight_scale` its groups' (scale, zero) (`flashpage.kernels.int4`).
    `out`: the tensor to write the result to (of out_dtype), else a new one. `quantized_output` (the next projection
    is FP8) allows a kernel set to return the result quantized per row (`flashpage.kernels.fp8.QuantizedRows`),
    which every `linear` takes as x; these references and the CPU and batch-invariant sets never do."""
    return composed_linear(rms_norm, silu_and_mul, x, weight, bias, norm_weight, eps, silu_mul, residual, out_dtype,
                           weight_scale, out=out)


def dense_product(x, weight, bias, residual):
    """x @ weight.T + bias + residual, one rounding for product and sum."""
    if residual is not None:
        return torch.addmm(residual if bias is None else residual + bias, x, weight.t())
    return F.linear(x, weight, bias)


def composed_linear(rms_norm, silu_and_mul, x, weight, bias, norm_weight, eps, silu_mul, residual, out_dtype,
                    weight_scale=None, quantize_rows=quantize_rows, product=dense_product, out=None):
    """`linear` from separate kernels (these references, or Triton's above the fused kernel's row limit)."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if weight_scale is not None:  # FP8 (activations quantized per token), or 4-bit codes
        y = int4_linear(x, weight, weight_scale) if weight.dtype == torch.uint8 else \
            scaled_linear(x, weight, weight_scale, quantize_rows)
        y = y if bias is None else y + bias
        y = y if residual is None else y + residual
    else:
        y = product(x, weight, bias, residual)
    if silu_mul:
        y = silu_and_mul(y)
    if out is not None:
        if out.shape != y.shape or out.dtype != (out_dtype or y.dtype):
            raise ValueError(f"out must be {list(y.shape)} {out_dtype or y.dtype}, got {list(out.shape)} {out.dtype}")
        return out.copy_(y)
    return y if out_dtype is None else y.to(out_dtype)


def rotate_half_rope(x, cos, sin):
    """Rotary embedding of x [T, H, D] in the rotate-half layout, cos/sin [T, D]."""
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None, :]


@functools.cache
def key_rotation(head_dim: int) -> torch.Tensor:
    """The orthogonal, symmetric [D, D] matrix an FP8 cache's keys and the queries are multiplied by after rotary
    embedding (`KVCache.keys_rotated`): [[H, H], [H, -H]] / sqrt(2) with H block-diagonal over the rotate-half
    layout's halves, its blocks normalised Hadamard matrices of the largest power of two dividing D / 2 (all of
    it for head dims 64 and 128), float64 on the CPU."""
    half = head_dim // 2
    block = half & -half
    i = torch.arange(half)
    parity = torch.tensor([bin(x).count("1") % 2 for x in range(block)])[(i % block)[:, None] & (i % block)[None, :]]
    h = torch.where((i // block)[:, None] == (i // block)[None, :], 1.0 - 2.0 * parity, 0.0).double()
    return torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)]) / (2 * block) ** 0.5


def rotate_keys(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] times key_rotation(D), rounded once to x's dtype."""
    return (x.double() @ key_rotation(x.shape[-1]).to(x.device)).to(x.dtype)


def rope_and_cache(q, k, cos, sin, v=None, kv_cache=None, slot_mapping=None):
    q, k = rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)
    if kv_cache is not None:
        if kv_cache.keys_rotated:
            q, k = rotate_keys(q), rotate_keys(k)
        reshape_and_cache(k, v, kv_cache, slot_mapping)
    return q, k


def filter_probs(probs, top_k, top_p, min_p):
    """Zero the tokens outside top-k, outside the top-p nucleus, or under min_p * max prob. Not renormalised."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop = (rank >= top_k[:, None]) | (mass_before >= top_p[:, None]) | (sorted_p < min_p[:, None] * sorted_p[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


def filtered_probs(logits, temperature, top_k, top_p, min_p):
    """The distribution a row samples from: softmax at its temperature (1 where greedy), then top-k, top-p and
    min-p. Not renormalised."""
    t = torch.where(temperature == 0, 1.0, temperature)
    return filter_probs(torch.softmax(logits.float() / t[:, None], dim=-1), top_k, top_p, min_p)


def _race(weights, seeds):
    """Exponential race (Gumbel-max): argmax(w / E), E ~ Exp(1), one generator per row seeded by its seed."""
    noise = torch.stack([torch.empty_like(weights[0]).exponential_(generator=torch.Generator(weights.device).manual_seed(s))
                         for s in seeds.tolist()])
    return (weights / noise).argmax(dim=-1)


def sample(logits, temperature, top_k, top_p, min_p, seeds, *, filtered=True, draft_tokens=None, draft_probs=None):
    is_greedy = temperature == 0
    tokens = logits.argmax(dim=-1)
    if not bool(is_greedy.all()):
        probs = filtered_probs(logits, temperature, top_k, top_p, min_p)
        tokens = torch.where(is_greedy, tokens, _race(probs, seeds))
        if draft_tokens is not None:  # the rejection sampler (Leviathan et al.): keep d with probability min(1, p/q)
            p = probs / probs.sum(-1, keepdim=True)
            d = draft_tokens.clamp(min=0)[:, None]
            u = torch.stack([torch.rand((), generator=torch.Generator(logits.device).manual_seed(s ^ 0x5EED))
                             for s in seeds.tolist()])
            residual = (p - draft_probs).clamp(min=0)
            keep = (u * draft_probs.gather(-1, d)[:, 0] < p.gather(-1, d)[:, 0]) | (residual.sum(-1) == 0)
            verified = torch.where(keep, d[:, 0], _race(residual, seeds))
            tokens = torch.where(is_greedy | (draft_tokens < 0), tokens, verified)
    return tokens, torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None])[:, 0]


def greedy(logits):
    """(argmax token [B], its log-probability [B]) of each row."""
    tokens = logits.argmax(dim=-1)
    return tokens, logits.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def apply_penalties(logits, rows, tokens, counts, repetition, presence, frequency):
    rows = rows.long()
    x = logits[rows, tokens.long()]
    rep = repetition[rows]
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - presence[rows] * (counts > 0) - frequency[rows] * counts
    logits[rows, tokens.long()] = x


def apply_token_bitmask(logits, bitmask):
    """In place: -inf wherever bit (t % 32) of bitmask[row, t // 32] is 0. bitmask [B, ceil(V / 32)] int32."""
    vocab = logits.shape[-1]
    t = torch.arange(vocab, device=logits.device)
    allowed = (bitmask[:, t // 32] >> (t % 32).to(torch.int32)) & 1
    logits.masked_fill_(allowed == 0, float("-inf"))


def in_basis(x: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """Heads x [T, H, D] in their KV head's orthonormal basis (basis [Hkv, D, D], columns the basis vectors; H a
    multiple of Hkv, query heads grouped as GQA groups them), computed in x's dtype; x itself for no basis."""
    if basis is None:
        return x
    t, h, d = x.shape
    hkv = basis.shape[0]
    return torch.einsum("tkgd,kde->tkge", x.reshape(t, hkv, h // hkv, d), basis.to(x.dtype)).reshape(t, h, d)


def sparq_attention(q, kv_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, *, r, k, recent=0,
                    softmax_scale=None, out=None, rows_per_chunk=64, drop_bits=0):
    """SparQ attention (Ribar et al., 2024), each query row over its sequence's keys up to its own position (as if
    every row were decoded in turn). Per row and KV head, with the keys turned by the cache's `sparq_basis` and the
    queries by its `sparq_query_basis` (the inverse transpose, so q.k is kept; the paper's basis is the identity)
    for steps 1 and 2:
    1. the r components where the group's queries are largest in magnitude (|q| summed over the group's heads);
    2. approximate scores from those components of every key, rounded to e4m3 (`as_sparq_copy`: what the cache's
       copy `k_t` holds, read from it where the cache has one; in 4 bits where it holds them so), each head's
       softmax temperature scaled by sqrt(||q[components]||_1 / ||q||_1) (the paper's correction for the dropped
       components);
    3. the k keys with the largest approximate probability summed over the group's heads, the row's last `recent`
       keys (its own among them) always among them (with drop_bits, the sums ranked as the Triton kernels rank a
       16-bit cache's: in fp16, less their lowest drop_bits bits, the first positions first among ties);
    4. exact attention over those k keys, weighted by alpha, the approximate probability they hold, plus
       (1 - alpha) times the mean of all the row's values;
    5. with the cache's value axes P [Hkv, D, m] (`v_t`), plus P times (the sum over the keys not chosen of their
       approximate probability times their values' coordinates P^T v, as `v_t` holds them, minus (1 - alpha) P^T
       mean): the unchosen keys' share goes to their own values as P sees them, the rest of each to the mean.
    A row that sees k keys or fewer attends to all of them exactly. The Triton kernels (`flashpage.kernels.sparq`)
    read a second, component-major copy of the keys and running value sums that `write_sparq_copies` keeps."""
    out = torch.empty_like(q) if out is None else out
    cu_q, lens_k = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    page = kv_cache.block_size
    dt = torch.promote_types(q.dtype, torch.float32)  # (float64 stays float64)
    basis = None if kv_cache.sparq_basis is None else kv_cache.sparq_basis.to(dt)
    query_basis = None if kv_cache.sparq_query_turn is None else kv_cache.sparq_query_turn.to(dt)
    axes = None if kv_cache.v_t is None else kv_cache.sparq_value_axes.to(dt)
    for i, len_k in enumerate(lens_k):
        blocks = block_table[i, : -(-len_k // page)].long()
        keys, values = (x.flatten(0, 1)[:len_k].to(dt) for x in read_pages(kv_cache, blocks, q.dtype))
        if kv_cache.k_t is None:  # the approximate scores' keys, as `k_t` would hold them
            turned = as_sparq_copy(in_basis(keys, basis))
        else:  # `k_t` itself
            turned = read_sparq_copy(kv_cache, blocks)[:len_k].to(dt)
        coords = None  # the values' coordinates along the axes, as `v_t` holds them, times their RMS: [keys, Hkv, m]
        if axes is not None:
            coords = kv_cache.v_t[blocks].transpose(1, 2).flatten(0, 1)[:len_k].to(dt) * \
                kv_cache.sparq_value_rms.to(dt)
        for start in range(cu_q[i], cu_q[i + 1], rows_per_chunk):
            end = min(start + rows_per_chunk, cu_q[i + 1])
            pos = torch.arange(len_k - (cu_q[i + 1] - start), len_k - (cu_q[i + 1] - end), device=q.device)
            out[start:end] = _sparq_rows(q[start:end].to(dt), keys, turned, values, pos, r, k, recent, scale,
                                         query_basis, coords, axes, drop_bits)
    return out


def _sparq_rows(q, keys, turned, values, pos, r, k, recent, scale, query_basis, coords=None, axes=None, drop_bits=0):
    """q [n, Hq, D] at positions pos [n]; keys/values [L, Hkv, D], `turned` the keys as the approximate scores see
    them and `query_basis` ([Hkv, D, D] or None) the queries' turn, all of one dtype; `coords` [L, Hkv, m] the
    values' coordinates along `axes` [Hkv, D, m] (or None: the mean value alone). Returns [n, Hq, D]."""
    n, hq, dim = q.shape
    length, hkv, _ = keys.shape
    qg = q.view(n, hkv, hq // hkv, dim)  # [n, Hkv, G, D]
    kf, vf = keys.transpose(0, 1), values.transpose(0, 1)  # [Hkv, L, D]
    qb = in_basis(q, query_basis).view(n, hkv, hq // hkv, dim)  # (the approximate scores' queries and keys)
    kb = turned.transpose(0, 1)
    comp = qb.abs().sum(2).topk(min(r, dim), dim=-1).indices  # [n, Hkv, r]
    q_hat = qb.gather(-1, comp[:, :, None, :].expand(-1, -1, qb.shape[2], -1))  # [n, Hkv, G, r]
    k_hat = kb[None].expand(n, -1, -1, -1).gather(-1, comp[:, :, None, :].expand(-1, -1, length, -1))  # [n,Hkv,L,r]
    frac = q_hat.abs().sum(-1) / qb.abs().sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
    temp = scale / frac.clamp_min(torch.finfo(torch.float32).tiny).sqrt()
    seen = torch.arange(length, device=q.device)[None, :] <= pos[:, None]  # [n, L]
    s_hat = (q_hat @ k_hat.transpose(-1, -2)) * temp[..., None]  # [n, Hkv, G, L]
    p_hat = torch.softmax(s_hat.masked_fill(~seen[:, None, None, :], float("-inf")), dim=-1)
    agg = p_hat.sum(2).masked_fill(~seen[:, None, :], -1.0)  # [n, Hkv, L]
    near = seen & (pos[:, None] - torch.arange(length, device=q.device)[None, :] < recent)  # [n, L]
    agg = agg.masked_fill(near[:, None, :], float("inf"))  # (ranked above every probability)
    if drop_bits:
        chosen = top_k_positions(agg.to(torch.float16), min(k, length), drop_bits=drop_bits).long()  # [n, Hkv, k]
    else:
        chosen = agg.topk(min(k, length), dim=-1).indices
    chosen_ok = chosen <= pos[:, None, None]
    alpha = (p_hat.gather(-1, chosen[:, :, None, :].expand_as(p_hat[..., :chosen.shape[-1]]))
             * chosen_ok[:, :, None, :]).sum(-1)  # [n, Hkv, G]
    alpha = torch.where((pos < k)[:, None, None], 1.0, alpha)  # every key seen: exact attention
    k_sel = kf[torch.arange(hkv, device=q.device)[None, :, None], chosen]  # [n, Hkv, k, D]
    v_sel = vf[torch.arange(hkv, device=q.device)[None, :, None], chosen]
    s = (qg @ k_sel.transpose(-1, -2)) * scale  # [n, Hkv, G, k]
    p = torch.softmax(s.masked_fill(~chosen_ok[:, :, None, :], float("-inf")), dim=-1)
    v_mean = vf.cumsum(1)[:, pos].transpose(0, 1) / (pos + 1)[:, None, None].to(q.dtype)  # [n, Hkv, D]
    o = alpha[..., None] * (p @ v_sel) + (1 - alpha[..., None]) * v_mean[:, :, None, :]
    if axes is not None:  # the unchosen keys' share, along the axes, from their own values instead of the mean
        unchosen = seen[:, None, :].expand(n, hkv, length).scatter(-1, chosen, False)  # [n, Hkv, L]
        tail = (p_hat * unchosen[:, :, None, :]) @ coords.transpose(0, 1)[None]  # [n, Hkv, G, m]
        tail = tail - (1 - alpha[..., None]) * torch.einsum("nhd,hdm->nhm", v_mean, axes)[:, :, None, :]
        o = o + torch.einsum("nhgm,hdm->nhgd", tail, axes)  # (0 where every key was chosen: alpha = 1)
    return o.reshape(n, hq, dim)


def as_sparq_copy(keys: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Turned keys [T, Hkv, D] as SparQ's copy `k_t` stores them, back in their own dtype: saturated to e4m3's range
    and rounded to it, or in 4 bits (`int4_keys`)."""
    if bits == 4:
        return int4_values(*int4_keys(keys)).to(keys.dtype)
    return keys.clamp(-FP8_MAX, FP8_MAX).to(FP8).to(keys.dtype)


INT4_STEPS = (0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5)  # the points between a 4-bit code's magnitudes (ties round down)


def int4_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [T, Hkv, D] as a 4-bit copy stores them: each key's scale, the smallest e4m3 value s with 7 s >= its
    largest |component| (at least e4m3's smallest, 2 ** -9; at most 448), [T, Hkv] FP8, and each component's code
    [T, Hkv, D] uint8: 8 plus its nearest multiple of s, -7 to 7, the magnitude found as the number of
    INT4_STEPS * s below |x| (products exact even in float32, so any writer can find the same codes). Offset by 8,
    a code c or-ed into the bits of the fp16 number 1024 is the number 1024 + c (16 c: 1024 + 16 c), so that the
    scores kernel widens codes with one logical operation and takes the offset off after its product."""
    amax = keys.abs().amax(-1).double()
    scale = (amax / 7).clamp(2.0**-9, FP8_MAX).to(FP8)
    bump = (scale.double() * 7 < amax) & (scale.double() < FP8_MAX)  # rounded below: the next e4m3 value up
    scale = (scale.view(torch.uint8) + bump.to(torch.uint8)).view(FP8)
    steps = torch.tensor(INT4_STEPS, dtype=torch.float64, device=keys.device)
    mag = (keys.abs().double()[..., None] > steps * scale.double()[..., None, None]).sum(-1)
    return (8 + torch.where(keys < 0, -mag, mag)).to(torch.uint8), scale


def int4_values(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., D] with their keys' scales [...] (`int4_keys`) as values, float64."""
    return (codes.double() - 8) * scale.double()[..., None]


def read_sparq_copy(kv_cache, blocks: torch.Tensor) -> torch.Tensor:
    """The keys of `blocks` as SparQ's copy `k_t` holds them, [blocks * block_size, Hkv, D] (float64 from 4 bits)."""
    k_t = kv_cache.k_t[blocks]  # [n, Hkv, D, block_size (/ 2)]
    if kv_cache.k_t_scale is None:
        return k_t.permute(0, 3, 1, 2).flatten(0, 1)
    codes = torch.cat((k_t & 15, k_t >> 4), -1).permute(0, 3, 1, 2)  # [n, block_size, Hkv, D]
    return int4_values(codes, kv_cache.k_t_scale[blocks].transpose(1, 2)).flatten(0, 1)


def as_value_coordinates(values: torch.Tensor, axes: torch.Tensor, rms: torch.Tensor) -> torch.Tensor:
    """Values [T, Hkv, D] as SparQ's copy `v_t` stores them: their coordinates along `axes` [Hkv, D, m] divided by
    `rms` [Hkv, m], rounded to e4m3 (`as_sparq_copy`), [T, Hkv, m] in the values' dtype."""
    return as_sparq_copy(torch.einsum("thd,hdm->thm", values, axes.to(values.dtype)) / rms.to(values.dtype))


def write_sparq_copies(k, kv_cache, slot_mapping, block_table, cu_seqlens_q, seq_lens_k) -> None:
    """A SparQ cache's extras for a step's new tokens, once their K/V are in the cache: each new key, in the cache's
    `sparq_basis`, into the component-major copy `k_t` [blocks, Hkv, D, block_size] (4-bit: `int4_keys`), and for
    each block written to, `v_cumsum` [blocks, Hkv, D] float32: the sum of the sequence's values from its first slot
    to the block's last written one; with value axes, each new value's coordinates into `v_t` (`as_value_coordinates`). (Blocks
    shared by prefix caching hold the same prefix in every sequence, so their sums hold for all.)"""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page = kv_cache.block_size
    turned = in_basis(k[keep], kv_cache.sparq_basis)
    if kv_cache.k_t_scale is None:
        kv_cache.k_t[slots // page, :, :, slots % page] = as_sparq_copy(turned).to(FP8)
    else:  # a block's first half of keys in its bytes' low nibbles, the second in the high ones, the other kept
        codes, kv_cache.k_t_scale[slots // page, :, slots % page] = int4_keys(turned)
        half = page // 2
        for high in (0, 1):
            at, code = slots[slots % page // half == high], codes[slots % page // half == high]
            place = (at // page, slice(None), slice(None), at % half)
            kv_cache.k_t[place] = (kv_cache.k_t[place] & (0xF0 >> 4 * high)) | (code << 4 * high)
    if kv_cache.v_t is not None:
        values = kv_cache.v.flatten(0, 1)[slots].float()
        kv_cache.v_t[slots // page, :, slots % page] = as_value_coordinates(
            values, kv_cache.sparq_value_axes, kv_cache.sparq_value_rms).to(FP8)
    cu, lens = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    for i, length in enumerate(lens):
        if length == 0 or cu[i + 1] == cu[i]:  # (a CUDA graph's padding sequence)
            continue
        first, last = (length - (cu[i + 1] - cu[i])) // page, (length - 1) // page
        blocks = block_table[i, :last + 1].long()
        total = kv_cache.v_cumsum[blocks[first - 1]].clone() if first else 0
        for j in range(first, last + 1):
            total = total + kv_cache.v[blocks[j], :min(page, length - j * page)].float().sum(0)
            kv_cache.v_cumsum[blocks[j]] = total
