"""Multi-branch speculative sampling (engine/spec/multi_branch.py): a tree node's token is distributed as the
target's p whatever the draft's q, when the children were drawn from q without replacement; the same correction
applied to children drawn with replacement is caught by the same test. (Point-mass proposals, prompt lookup, are
verified by the tree walk alone: they are no draws from a q.)"""

from __future__ import annotations

import torch

from conftest import chi2_limit
from flashpage.engine.spec.multi_branch import multi_branch_draw


def draw(p, q, children, gen):
    n, m = children.shape
    uniforms = torch.rand(n, m, generator=gen)
    generators = [torch.Generator().manual_seed(int(s)) for s in torch.randint(0, 2**62, (n,), generator=gen)]
    return multi_branch_draw(p.repeat(n, 1), q.repeat(n, 1), children, uniforms, generators)


def chi2(tokens, p):
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_children_drawn_without_replacement_give_the_target_distribution():
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    vocab, draws = 10, 12000
    p = torch.softmax(1.5 * torch.randn(vocab, generator=gen), -1)
    q = torch.softmax(1.5 * torch.randn(vocab, generator=gen), -1)
    last = 0.0
    for m in (1, 2, 4):
        gumbel = -torch.log(-torch.log(torch.rand(draws, vocab, generator=gen)))
        children = (q.log() + gumbel).topk(m, dim=-1).indices  # without replacement, in the order drawn
        tokens = draw(p, q, children, gen)
        assert chi2(tokens, p) < chi2_limit(vocab - 1), (m, torch.bincount(tokens, minlength=vocab), p * draws)
        accepted = float((tokens[:, None] == children).any(-1).double().mean())
        if m == 1:  # the rejection sampler's rate, sum(min(p, q))
            rate = float(torch.minimum(p, q).sum())
            assert abs(accepted - rate) < 4 * (rate * (1 - rate) / draws) ** 0.5
        else:  # more children, more accepted
            assert accepted > last
        last = accepted
    # children drawn with replacement, the same correction applied: caught. On a pair where that bias is large
    # (chi-square 400-560 over 30 seeds): on random pairs it can hide in 12,000 draws (36 of 300 missed)
    p = torch.softmax(-0.3 * torch.arange(vocab, dtype=torch.float32), -1)
    q = torch.tensor([0.6] + [0.4 / (vocab - 1)] * (vocab - 1))
    wrong = torch.multinomial(q, draws * 4, replacement=True, generator=gen).view(draws, 4)
    assert chi2(draw(p, q, wrong, gen), p) > chi2_limit(vocab - 1)


def test_rows_with_fewer_children_and_a_target_with_zeros():
    """Rows padded with -1 (a node with fewer children than the widest) and a target that gives some tokens
    nothing (top-k): still the target's distribution, and no token outside its support."""
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    vocab, draws = 8, 12000
    p = torch.softmax(torch.randn(vocab, generator=gen), -1)
    p[p.argsort()[:3]] = 0.0
    p /= p.sum()
    q = torch.softmax(torch.randn(vocab, generator=gen), -1)
    gumbel = -torch.log(-torch.log(torch.rand(draws, vocab, generator=gen)))
    children = (q.log() + gumbel).topk(3, dim=-1).indices
    children[: draws // 2, 1:] = -1
    children[draws // 2: 3 * draws // 4, 2] = -1
    tokens = draw(p, q, children, gen)
    assert int((p[tokens] == 0).sum()) == 0
    support = p > 0
    counts = torch.bincount(tokens, minlength=vocab).double()[support]
    expected = p[support].double() * draws
    assert float(((counts - expected) ** 2 / expected).sum()) < chi2_limit(int(support.sum()) - 1)
