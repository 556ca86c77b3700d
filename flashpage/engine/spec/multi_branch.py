"""Multi-branch speculative sampling (SpecInfer, Miao et al. 2024), in its form for children drawn without
replacement (recursive rejection sampling, Jeon et al. 2024): the draw at a tree node whose children were proposed.

A node's children c_1..c_m were drawn one after another from the draft's distribution q at that node, each
without the ones before it. The target's distribution there is p. Child j is accepted with probability
min(1, p_j(c_j) / q_j(c_j)); on a rejection the target's distribution becomes the residual
p_{j+1} = norm(max(p_j - q_j, 0)) and the draft's q_{j+1} = q_j without c_j, renormalised. When every child is
rejected the token is drawn from p_{m+1}. Every stage leaves the token distributed as p_j, whatever the children
were, so the node's token is distributed as p: lossless. A rejected child has no mass left in any later residual,
so the token drawn is a child exactly when that child was accepted, and the engine's tree walk (follow the child
whose token was drawn) keeps working unchanged. A chain is the case m = 1: the rejection sampler of
`kernels/sampling.py`. Proposals that are no draws from a q (prompt lookup, a greedy request's top-k tree) are
verified by the tree walk alone, on the target's own draws.

The stages' distributions do not depend on which children are accepted, only on the children, so every stage's
test is computed at once, on the device, for all such rows of a step.
"""

from __future__ import annotations

import torch


def multi_branch_draw(p: torch.Tensor, q: torch.Tensor, children: torch.Tensor, uniforms: torch.Tensor,
                      generators: list[torch.Generator]) -> torch.Tensor:
    """p [R, V] the target's distributions (sampling parameters applied), q [R, V] the draft's, children [R, m]
    (-1 where a row has fewer), uniforms [R, m] in [0, 1); generators: one per row, for the residual draw.
    Returns the tokens [R] (int64)."""
    p, q = p.double(), q.double().clone()
    rows = torch.arange(p.shape[0], device=p.device)
    accepted = torch.full((p.shape[0],), -1, dtype=torch.int64, device=p.device)
    for j in range(children.shape[1]):
        c = children[:, j]
        live = (c >= 0) & (accepted < 0)
        cj = c.clamp(min=0)
        pc, qc = p[rows, cj], q[rows, cj]
        take = live & (uniforms[:, j].double() * qc < pc)
        accepted = torch.where(take, c, accepted)
        # rows still looking: the residual of p after q, and q without this child (rows that are done keep theirs)
        residual = (p - q).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        step = (live & ~take)[:, None]
        # (no mass left: p <= q everywhere, so p == q, and a child drawn from q would have been accepted)
        p = torch.where(step & (mass > 0), residual / mass.clamp(min=1e-300), p)
        q[rows[live], cj[live]] = 0.0
        q = q / q.sum(-1, keepdim=True).clamp(min=1e-300)
    drawn = torch.stack([torch.multinomial(p[i].float(), 1, generator=g)[0] for i, g in enumerate(generators)]) \
        if len(generators) else accepted
    return torch.where(accepted >= 0, accepted, drawn)
