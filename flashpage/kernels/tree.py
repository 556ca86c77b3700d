"""Token trees for attention (speculative decoding's tree verification): how a step's queries of one sequence see
each other.

A sequence's q_len query tokens are the last q_len keys of its cache, in an order where every node comes after its
parent. `query_mask` [total_q] int64 gives, for each query row, the bits of its sequence's queries it sees: bit j
set where it sees the sequence's j-th query of the step (its ancestors and itself); every key before the step's
first query (the cached prefix) is seen by all. A chain (bits 0..i for query i, or simply -1) is ordinary causal
attention. A tree has at most 64 nodes (one int64 per row); a row's step queries past the 64th are seen causally,
so the rows of other sequences in the batch (prompt chunks of any length) take -1. Positions for the rotary
embedding come separately (a node's depth), as the kernels mask by a key's place in the cache, not by its
position.
"""

from __future__ import annotations

import torch

MAX_TREE_TOKENS = 64


def tree_mask(parents: list[int], seen_before: int = 0) -> list[int]:
    """The bits of each node of a tree given as parents (-1 for a root, else an earlier node's index).
    `seen_before`: that many of the step's queries come before the tree's first and every node sees them (a CUDA
    graph's padding, which sits on keys of the cached prefix)."""
    bits: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} is not an earlier node of the tree")
        bits.append((bits[p] if p >= 0 else 0) | 1 << i)
    if seen_before + len(parents) > MAX_TREE_TOKENS:
        raise ValueError(f"a token tree has at most {MAX_TREE_TOKENS} nodes (with the queries before it), got "
                         f"{seen_before + len(parents)}")
    bits = [b << seen_before | (1 << seen_before) - 1 for b in bits]
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]  # as int64


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (a root's is 0): added to the position of the step's first query, its position."""
    out: list[int] = []
    for p in parents:
        out.append(out[p] + 1 if p >= 0 else 0)
    return out


def within_depth(tokens: list[int], parents: list[int], depth: int) -> tuple[list[int], list[int]]:
    """The nodes of a tree (parents first) on paths of at most `depth` nodes, parents renumbered."""
    place: dict[int, int] = {}
    kept_tokens, kept_parents = [], []
    for i, (t, d) in enumerate(zip(tokens, depths(parents))):
        if d < depth:
            place[i] = len(kept_tokens)
            kept_tokens.append(t)
            kept_parents.append(place[parents[i]] if parents[i] >= 0 else -1)
    return kept_tokens, kept_parents


def ancestors(parents: list[int], i: int) -> list[int]:
    """The path from node i's root down to node i (both included)."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def breadth_first_tree(nodes: int, branching: int) -> list[int]:
    """Parents of a tree of `nodes` nodes, each with `branching` children, filled breadth first."""
    return [-1] + [(i - 1) // branching for i in range(1, nodes)]


def check_query_mask(query_mask: torch.Tensor, q: torch.Tensor, causal: bool, window_size) -> None:
    if query_mask.dtype != torch.int64 or query_mask.shape != (q.shape[0],):
        raise ValueError(f"query_mask must be int64 [total_q] = [{q.shape[0]}], got {query_mask.dtype} "
                         f"{tuple(query_mask.shape)}")
    if not causal or tuple(window_size) != (-1, -1):
        raise ValueError("a token tree's attention is causal over the cache, with no sliding window")


def tree_visible(bits: torch.Tensor, len_k: int) -> torch.Tensor:
    """Boolean [len_q, len_k]: which keys each of a sequence's queries (bits [len_q]) sees (reference kernels)."""
    len_q = bits.shape[0]
    first = len_k - len_q  # the key of the step's first query (below 0 where a CUDA graph's padding has no key)
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=bits.device)
    keys = torch.arange(max(first, 0), min(len_k, first + MAX_TREE_TOKENS), device=bits.device)
    mask[:, keys] = (bits[:, None] >> (keys - first)[None, :]) & 1 == 1
    return mask
