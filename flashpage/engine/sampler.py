"""Batched next-token sampling on the device: penalties, min_tokens, temperature, top-k/top-p/min-p, seeds.

Python loops run over the batch's rows (to gather each row's token ids or generator), never over the vocabulary.
"""

from __future__ import annotations

import torch

from flashpage.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, token_ids: list[list[int]], output_ids: list[list[int]],
                    params: list[SamplingParams]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (transformers' rule); presence/frequency over output."""
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    sub = logits[rows]
    seen = torch.zeros_like(sub, dtype=torch.bool)
    counts = torch.zeros_like(sub)
    for j, i in enumerate(rows):
        seen[j, torch.tensor(token_ids[i], device=dev, dtype=torch.long).clamp_(0, vocab - 1)] = True
        out = torch.tensor(output_ids[i], device=dev, dtype=torch.long)
        counts[j].index_add_(0, out, torch.ones_like(out, dtype=sub.dtype))
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=dev)[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=dev)[:, None]
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=dev)[:, None]
    sub = sub - presence * (counts > 0) - frequency * counts
    logits = logits.clone()
    logits[rows] = sub
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] (int64). Rows with temperature 0 take the argmax."""
    dev = logits.device
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    probs = filter_probs(
        probs,
        top_k=torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params], device=dev),
        top_p=torch.tensor([p.top_p for p in params], device=dev),
        min_p=torch.tensor([p.min_p for p in params], device=dev),
    )
    # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) samples from p. Each row draws its
    # noise from its own generator, so a seeded request does not depend on its neighbours.
    noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=g) for g in generators])
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=dev)
    return torch.where(is_greedy, greedy, sampled)


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens outside top-k, outside the top-p nucleus, or under min_p * max prob. Not renormalised."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop = (rank >= top_k[:, None]) | (mass_before >= top_p[:, None]) | (sorted_p < min_p[:, None] * sorted_p[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, top: list[int | None]) -> tuple[list[float], list[dict | None]]:
    """Log-probabilities under the model's raw distribution: of `tokens`, and each row's top-k (plus its token)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens[:, None])[:, 0].tolist()
    k_max = max((k for k in top if k), default=0)
    tops = lp.topk(k_max, dim=-1) if k_max else None
    out = []
    for i, k in enumerate(top):
        if k is None:
            out.append(None)
            continue
        entry = {int(t): float(v) for t, v in zip(tops.indices[i, :k].tolist(), tops.values[i, :k].tolist())} if k else {}
        entry[int(tokens[i])] = chosen[i]
        out.append(entry)
    return chosen, out
