"""Dynamic draft trees (EAGLE-2, Li et al. 2024): a token tree grown from a draft's distributions, level by level.

The `width` likeliest tokens after a sequence's last token are the first level. Each further level expands the
previous level's `width` likeliest nodes (by the draft's probability of the whole path from the root, the product
of its tokens' probabilities) by their `width` likeliest next tokens. The proposal is the `size` likeliest nodes of
everything drafted: a path's probability never exceeds its parent's, so they form a tree. Every node is a point
mass, so the engine's tree walk by the target's own draws verifies it losslessly, greedy or sampled.

A sequence given a random generator (a sampled request) has each node's children drawn instead, without
replacement from the draft's distribution there (Gumbel top-k, SpecInfer's sampled expansion), and the target
verifies them by multi-branch speculative sampling (engine/spec/multi_branch.py), which needs each node's children
to be its first draws in the order drawn: their scores are made non-increasing in that order, so whatever subtree
is kept holds a prefix of them.

The draft is asked, once a level, for its log-probabilities after each node expanded at that level
(`expand`): EAGLE's one layer, or a draft model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashpage.engine.step import SeqStep, StepPlan


@dataclass
class Node:
    token: int
    parent: int  # the parent's index among its sequence's nodes; -1: a child of the sequence's last token
    depth: int  # 1: the token right after the last one
    score: float  # the draft's log-probability of the path down to it
    row: int  # the row of the draft's distributions it was drawn from (first's rows, then each level's, in turn)


# expand(trees, expanded, level): each sequence's nodes and the indices of those run through the draft so far
# (parents first; the last ones are this level's); returns the draft's log-probabilities [rows, V] after each
# node of depth `level` in `expanded`, sequences in order.
Expand = Callable[[list[list[Node]], list[list[int]], int], torch.Tensor]


def grow_trees(first: torch.Tensor, expand: Expand, width: int, depth: int, size: int,
               generators: list[torch.Generator | None] | None = None) -> list[tuple[list[int], list[int] | None,
                                                                                   list[int]]]:
    """Each sequence's tree from `first` [B, V], the draft's log-probabilities after its last token: (tokens,
    parents, rows) parents first, parents None where the tree is a chain, rows: where each token was drawn from.
    `generators`: per sequence, None (the likeliest children) or the generator that draws its children."""
    gens = generators or [None] * first.shape[0]
    picks = _pick(first, gens, width)
    trees = [children(next(picks), None, -1, width, i) for i in range(first.shape[0])]
    expanded: list[list[int]] = [[] for _ in trees]
    offset = first.shape[0]
    for level in range(1, depth):
        for nodes, done in zip(trees, expanded):
            at_level = [n for n, node in enumerate(nodes) if node.depth == level]
            done += sorted(at_level, key=lambda n: -nodes[n].score)[:width]
        owners = [i for i, (nodes, done) in enumerate(zip(trees, expanded)) for n in done if nodes[n].depth == level]
        logprobs = expand(trees, expanded, level)
        picks = _pick(logprobs, [gens[i] for i in owners], width)
        row = offset
        for nodes, done in zip(trees, expanded):
            for n in [n for n in done if nodes[n].depth == level]:
                nodes += children(next(picks), nodes[n], n, width, row)
                row += 1
        offset += logprobs.shape[0]
    return [best(nodes, size) for nodes in trees]


def level_plan(seq_ids: list[int], roots: list[int], tables: list[list[int]], trees: list[list[Node]],
               expanded: list[list[int]], level: int) -> tuple[StepPlan, list[int]]:
    """A draft step computing every expanded node again, one tree per sequence (the tree mask covers a step's own
    queries only, so a level cannot attend to nodes an earlier step wrote): node positions are `roots[i]` (the
    position of the sequence's last drafted element) plus depth, its slots follow. Returns the plan and the rows of
    the nodes of depth `level`, the rows `expand` answers for."""
    plan, rows = StepPlan(), []
    for seq_id, root, table, nodes, order in zip(seq_ids, roots, tables, trees, expanded):
        place = {n: j for j, n in enumerate(order)}
        rows += [plan.num_logits + j for j, n in enumerate(order) if nodes[n].depth == level]
        plan.add(SeqStep(seq_id, [nodes[n].token for n in order], [root + nodes[n].depth for n in order], table,
                         num_logits=len(order), tree=[place.get(nodes[n].parent, -1) for n in order]))
    return plan, rows


def _pick(logprobs: torch.Tensor, generators: list[torch.Generator | None], width: int):
    """Each row's `width` children (token ids, log-probabilities): its likeliest, or, where the row's sequence has
    a generator, drawn without replacement (in the order drawn, log-probabilities made non-increasing)."""
    keys = logprobs
    drawn = [r for r, g in enumerate(generators) if g is not None]
    if drawn:
        keys = logprobs.clone()
        for r in drawn:
            u = torch.rand(logprobs.shape[-1], generator=generators[r], device=logprobs.device)
            keys[r] -= torch.log(-torch.log(u.clamp(min=1e-20)))  # + Gumbel noise
    top = keys.topk(width, dim=-1).indices
    values = logprobs.gather(-1, top)
    if drawn:
        values[drawn] = values[drawn].cummin(dim=-1).values
    return iter(list(zip(top.tolist(), values.tolist())))


def children(row: tuple[list[int], list[float]], parent: Node | None, index: int, width: int,
             q_row: int) -> list[Node]:
    """Nodes for a row's picks; a token the draft gives no probability is none (fewer candidates than `width`)."""
    base, depth = (parent.score, parent.depth + 1) if parent else (0.0, 1)
    return [Node(t, index, depth, base + v, q_row) for t, v in zip(*row) if v > float("-inf")][:width]


def best(nodes: list[Node], size: int) -> tuple[list[int], list[int] | None, list[int]]:
    """The `size` likeliest nodes, parents first: (tokens, parents, rows), parents None for a chain."""
    chosen: list[int] = []
    for n in sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, nodes[n].depth)):
        if nodes[n].parent < 0 or nodes[n].parent in chosen:
            chosen.append(n)
            if len(chosen) == size:
                break
    chosen.sort(key=lambda n: (nodes[n].depth, n))
    place = {n: j for j, n in enumerate(chosen)}
    parents = [place.get(nodes[n].parent, -1) for n in chosen]
    return ([nodes[n].token for n in chosen], None if parents == list(range(-1, len(parents) - 1)) else parents,
            [nodes[n].row for n in chosen])
