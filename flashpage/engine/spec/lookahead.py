"""Lookahead decoding (Fu et al., 2024): n-grams guessed by Jacobi iteration, verified in the same forward; no
draft model.

Each decoding sequence keeps N - 1 levels of W guesses (Jacobi trajectories) and a pool of n-grams, at most G per
first token. One step computes, as one token tree rooted at the sequence's last token:
- the verification branch: the pool's n-grams that start with the last token (N - 1 tokens each, merged as a
  trie), exactly as prompt lookup's candidates are verified (`walk_tree` keeps the path the model's own draws
  follow, so the method is lossless, greedy or sampled);
- the lookahead branch: level 0's guesses as a chain from the last token (column 0 is the last token itself),
  and from each column i a chain of levels 1 .. N - 2 at positions i + 1 .. i + N - 2, so that the token of
  level j in column i sees the last token, level 0's columns 1 .. i and its own column's levels below it: the
  mask of the paper's 2D window, and a tree.
After the step (`observe`), the draws after the last level's tokens become the new last level (the others move
down a level), and each column's diagonal, from the old level 0 to the new draw, is an n-gram at consecutive
positions, added to the pool. llama.cpp's `examples/lookahead` is the reference this follows (its level update
for every emitted token, its pool of G per first token). With `pool_from_context` (the default) the pool also
holds the sequence's own n-grams: the prompt's from the start (the paper's code offers that as POOL_FROM_PROMPT)
and the answer's as it grows, so text the answer repeats, from its prompt or from itself, is verified at once.
"""

from __future__ import annotations

import random

from flashpage.engine.spec.ngram import trie


class LookaheadProposer:
    probs = None  # proposals are point masses, verified by the draws decoding would make

    def __init__(self, spec):
        self.window, self.ngram, self.guesses = spec.window_size, spec.ngram_size, spec.guess_set_size
        self.pool_from_context = spec.pool_from_context
        self.levels: dict[int, list[list[int]]] = {}  # seq_id -> N - 1 levels of W guesses
        self.pools: dict[int, dict[int, list[tuple[int, ...]]]] = {}  # seq_id -> first token -> n-grams, newest last
        self.last_level: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (tree size, last level's node per column)

    def propose(self, running) -> None:
        for seq in running:
            if seq.num_uncomputed != 1 or seq.num_pending:  # not decoding with every token known
                continue
            levels = self.levels.get(seq.seq_id)
            if levels is None:  # Jacobi starts anywhere: guesses drawn from the prompt (seeded by the sequence)
                rng = random.Random(seq.seq_id)
                levels = self.levels[seq.seq_id] = [[rng.choice(seq.token_ids) for _ in range(self.window)]
                                                    for _ in range(self.ngram - 1)]
                self.pools[seq.seq_id] = {}
                if self.pool_from_context:
                    self._learn(self.pools[seq.seq_id], seq.token_ids)
            nodes, parents = trie(self.pools[seq.seq_id].get(seq.token_ids[-1], []))  # the verification branch
            column_root = [-1]  # the node each column's upper levels hang from: level 0's, column 0 the last token
            for i in range(1, self.window):
                nodes.append(levels[0][i])
                parents.append(column_root[-1])
                column_root.append(len(nodes) - 1)
            last = []
            for i in range(self.window):
                parent = column_root[i]
                for j in range(1, self.ngram - 1):
                    nodes.append(levels[j][i])
                    parents.append(parent)
                    parent = len(nodes) - 1
                last.append(parent)
            seq.proposal, seq.proposal_parents = nodes, parents
            self.last_level[seq.seq_id] = (len(nodes), last)

    def observe(self, seq, drawn: list[int], emitted: list[int], hidden=None) -> None:
        """After every step that drew for `seq`: drawn[0] the token drawn after the last token, drawn[i + 1] the
        one after node i; the rows `emitted` gave its tokens. Only a whole verified tree teaches: a tree that was
        cut (a grammar keeps one branch) or not scheduled does not."""
        size, last = self.last_level.pop(seq.seq_id, (None, None))
        if size is None or len(drawn) != size + 1:
            return
        levels, pool = self.levels[seq.seq_id], self.pools[seq.seq_id]
        for v in range(len(emitted)):  # as llama.cpp: the levels move once per emitted token
            previous = levels[0]
            levels[:-1] = levels[1:]
            levels[-1] = [drawn[node + 1] for node in last] if v == 0 else list(levels[0])
            if v:
                continue
            for f in range(self.window):  # each column's diagonal: an n-gram at consecutive positions
                self._remember(pool, previous[f], tuple(level[f] for level in levels))
        if self.pool_from_context:  # and the n-grams the answer itself makes, ending at each emitted token
            known = seq.num_known  # (the emitted tokens go where the PENDING ones are)
            self._learn(pool, seq.token_ids[max(0, known - self.ngram + 1):known] + [drawn[r] for r in emitted])

    def _learn(self, pool: dict[int, list[tuple[int, ...]]], tokens: list[int]) -> None:
        """Every n-gram of consecutive `tokens`, under its first token."""
        for i in range(len(tokens) - self.ngram + 1):
            self._remember(pool, tokens[i], tuple(tokens[i + 1:i + self.ngram]))

    def _remember(self, pool: dict[int, list[tuple[int, ...]]], first: int, gram: tuple[int, ...]) -> None:
        """Keep an n-gram after `first`, the G newest per first token."""
        grams = pool.setdefault(first, [])
        if gram not in grams:
            grams.append(gram)
            del grams[:-self.guesses]

    def release(self, seq_id: int) -> None:
        self.levels.pop(seq_id, None)
        self.pools.pop(seq_id, None)
        self.last_level.pop(seq_id, None)
