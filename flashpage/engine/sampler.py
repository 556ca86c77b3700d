"""Batched next-token sampling on the device: temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import torch

from flashpage.sampling_params import SamplingParams


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
