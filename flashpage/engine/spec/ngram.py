"""Prompt lookup (LLMA): the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

Text that copies from its context (a summary quoting its source, an edited piece of code) repeats n-grams of the
prompt; proposing what came after the previous occurrence costs no model at all. The longest n in
[min_n, max_n] with a match wins; among its matches the latest one (closest context) that is followed by k tokens,
else the latest.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram_tree(tokens: list[int], k: int, min_n: int, max_n: int, width: int) -> tuple[list[int], list[int]]:
    """Up to `width` distinct continuations of up to k tokens, from the latest matches of the longest recurring
    suffix, merged into a token tree: (tokens, parents), parents before children, -1 for a child of the sequence's
    last token. ([], []) where no suffix recurs."""
    size = len(tokens)
    if size < min_n + 1:
        return [], []
    arr = np.asarray(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        hits = np.flatnonzero((sliding_window_view(arr[:size - 1], n) == arr[size - n:]).all(1))
        if not hits.size:
            continue
        found: dict[tuple[int, ...], None] = {}  # distinct continuations, latest first
        for start in hits[::-1] + n:
            found.setdefault(tuple(tokens[start:start + k]))
            if len(found) == width:
                break
        return trie(found)
    return [], []


def trie(candidates) -> tuple[list[int], list[int]]:
    """Token sequences merged into a tree where shared prefixes share nodes: (tokens, parents), parents before
    children, -1 for a child of the sequence's last token."""
    nodes, parents, children = [], [], {}  # children: (parent, token) -> node
    for candidate in candidates:
        parent = -1
        for t in candidate:
            if (parent, t) not in children:
                children[parent, t] = len(nodes)
                nodes.append(t)
                parents.append(parent)
            parent = children[parent, t]
    return nodes, parents


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k proposed next tokens for `tokens` (prompt + output so far); [] where no suffix recurs."""
    size = len(tokens)
    if size < min_n + 1:
        return []
    arr = np.asarray(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows starting at 0 .. size - 1 - n: each is followed by at least one token, and none is the suffix
        hits = np.flatnonzero((sliding_window_view(arr[:size - 1], n) == arr[size - n:]).all(1))
        if hits.size:
            full = hits[hits + n + k <= size]
            start = int(full[-1] if full.size else hits[-1]) + n
            return tokens[start:start + k]
    return []


class NgramProposer:
    probs = None  # a proposal is a point mass: verification needs no probabilities

    def __init__(self, spec):
        self.k, self.min_n, self.max_n = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        self.width = spec.tree_width

    def propose(self, running) -> None:
        for seq in running:
            if seq.num_uncomputed != 1 or seq.num_pending:  # not decoding with every token known
                continue
            if self.width == 1:
                seq.proposal = propose_ngram(seq.token_ids, self.k, self.min_n, self.max_n)
                continue
            seq.proposal, parents = propose_ngram_tree(seq.token_ids, self.k, self.min_n, self.max_n, self.width)
            if parents != list(range(-1, len(parents) - 1)):  # (a single continuation stays a chain)
                seq.proposal_parents = parents

    def release(self, seq_id: int) -> None:
        pass
