"""Typical acceptance (Medusa, Cai et al. 2024, section 2.3.1): a LOSSY way to keep more proposed tokens when
sampling.

Lossless verification keeps a proposed token only where the target's own draw is that token, so at a high
temperature even a good guess is often lost. Typical acceptance keeps a proposed token x wherever the target's
distribution p at its place (softmax of the logits after penalties and masks, at the request's temperature) gives
it p(x) > min(threshold, alpha exp(-H(p))): the rule relaxes where the target itself is unsure (high entropy H).
The path kept is the deepest whose every node passes, and the token after it is the target's own draw there. The
output is then no longer distributed as the model's (the measured cost is in docs/spec.md), so it runs only with
`acceptance_method: "typical_acceptance_sampler"`. Greedy requests (temperature 0) keep exact verification.
"""

from __future__ import annotations

import torch

from flashpage.engine.step import SampledToken


def typical_walk(tokens: list[int], parents: list[int], logits: torch.Tensor, temperature: float,
                 threshold: float, alpha: float) -> list[int]:
    """The proposed nodes kept: the deepest path from the root whose nodes all pass the rule (the first such in
    node order). `logits`: the sequence's sample rows, row 0 after its last token, row i + 1 after node i."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    bound = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    rows = torch.tensor([parent + 1 for parent in parents], device=logits.device)
    typical = (p[rows, torch.tensor(tokens, device=logits.device)] > bound[rows]).tolist()
    paths: dict[int, list[int]] = {-1: []}
    best: list[int] = []
    for i, parent in enumerate(parents):  # (parents come before their children)
        if typical[i] and parent in paths:
            paths[i] = paths[parent] + [i]
            best = paths[i] if len(paths[i]) > len(best) else best
    return best


def kept_token(seq_id: int, token: int, logits_row: torch.Tensor, drawn: SampledToken) -> SampledToken:
    """A token typical acceptance kept where the target drew `drawn`: its log-probability (and rank, where the
    request asked for log-probs) from the row's logits after penalties and masks; the row's top log-probs are
    the draw's."""
    logprobs = torch.log_softmax(logits_row.float(), dim=-1)
    chosen = logprobs[token]
    rank = int((logprobs > chosen).sum()) + 1 if drawn.rank is not None else None
    return SampledToken(seq_id, token, float(chosen), rank, drawn.top)
