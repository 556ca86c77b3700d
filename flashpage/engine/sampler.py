"""Sampler: one step's sampling on the device, from each row's SamplingParams.

Builds the per-row tensors on the host and uploads them without waiting for the GPU, then calls the kernel
set's `apply_penalties` and `sample` (Triton on the GPU, PyTorch references on CPU). Log-probabilities of the
chosen tokens (and top-k where asked) are computed on the device too; nothing here reads a result back.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass

import torch

from flashpage.engine.inputs import upload
from flashpage.engine.spec.multi_branch import multi_branch_draw
from flashpage.engine.step import SampleRow
from flashpage.kernels.reference import filtered_probs
from flashpage.kernels.sampling import chunk_classes


@dataclass
class Sampled:
    tokens: torch.Tensor  # [B] int64, on the device
    logprobs: torch.Tensor  # [B] float32: log-probability of each chosen token under the raw distribution
    ranks: torch.Tensor | None  # [B] int64: each chosen token's rank (1 = most likely), where some row asked
    top_ids: torch.Tensor | None  # [B, k] where some row asked for top logprobs
    top_logprobs: torch.Tensor | None


def sample_rows(ops, logits: torch.Tensor, rows: list[SampleRow], draft_tokens: list[tuple[int, ...]] | None = None,
                draft_probs: torch.Tensor | None = None, bitmask: torch.Tensor | None = None) -> Sampled:
    """logits [B, V] float32 (modified in place), one row per SampleRow. Rows with draft tokens (drawn from that row
    of draft_probs [B, V]) verify them: one with the rejection sampler, several (a tree node's children, in the
    order drawn) with multi-branch speculative sampling. bitmask [B, ceil(V / 32)] int32 on the device: the grammar
    masks of constrained rows (bit t % 32 of word t // 32 allows token t)."""
    dev, vocab = logits.device, logits.shape[-1]
    params = [r.params for r in rows]
    single = branching = None
    if draft_tokens is not None:
        single = upload([d[0] if len(d) == 1 else -1 for d in draft_tokens], torch.int64, dev)
        branching = [i for i, d in enumerate(draft_tokens) if len(d) > 1 and params[i].temperature > 0]
    masked = [(i, t) for i, r in enumerate(rows) for t in r.blocked]
    k = max((vocab if p.logprobs == -1 else p.logprobs for p in params if p.logprobs), default=0)
    ranked = any(p.logprobs is not None for p in params)
    # Log-probabilities are reported under the raw distribution: taken before penalties and masks change it.
    # Otherwise the chosen tokens' own come with them, and a full log-softmax is only for top-k and ranks.
    changed = bool(masked) or any(p.changes_logits for p in params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if changed or ranked or branching else None
    _restrict(logits, rows)
    _penalise(ops, logits, rows)
    if bitmask is not None:
        ops.apply_token_bitmask(logits, bitmask)
    if masked:
        logits[upload([i for i, _ in masked], torch.int64, dev), upload([t for _, t in masked], torch.int64, dev)] = float("-inf")
    if branching:  # (the rows as the sampler sees them, before its kernel)
        tree_draws = _multi_branch(logits[branching], [rows[i] for i in branching],
                                   [draft_tokens[i] for i in branching], draft_probs[branching])
    if all(p.greedy for p in params):
        tokens, chosen = ops.greedy(logits)
    else:
        tokens, chosen = ops.sample(logits, *_sampling_tensors(rows, vocab, dev),
                                    filtered=any(0 < p.top_k < vocab or p.top_p < 1 for p in params),
                                    draft_tokens=single, draft_probs=draft_probs)
    if branching:
        tokens[upload(branching, torch.int64, dev)] = tree_draws
    if raw_logprobs is not None:  # (the same values the ranks and top-k compare against)
        chosen = raw_logprobs.gather(-1, tokens[:, None])[:, 0]
    ranks = (raw_logprobs > chosen[:, None]).sum(-1) + 1 if ranked else None
    top = raw_logprobs.topk(k, dim=-1) if k else None
    return Sampled(tokens, chosen, ranks, top.indices if top else None, top.values if top else None)


def warm_up_sampling(ops, vocab: int, device: torch.device, max_rows: int, drafts: bool = False) -> None:
    """Compile the sampling kernels' variants before requests need them: they compile once per chunk count, which
    follows how many rows a step samples (`kernels/sampling.py`, chunk_classes), per use of top-k/top-p, and
    with `drafts` per draft verification (a draft model's proposals).
    Sampled requests reach few of them (a first request with the default sampling, temperature 1 and no top-p,
    waited 0.8 s for its variant on an H100 after a warm-up that drew with top-p only). Each, once, on zero
    logits; and the penalties' kernel (Triton compiles again for an entry count of 1 and for multiples of 16)
    and the grammar mask's."""
    for rows in chunk_classes(vocab, device, max_rows):
        ones = torch.ones(rows, device=device)
        verify = {"draft_tokens": torch.full((rows,), -1, device=device),
                  "draft_probs": torch.zeros(rows, vocab, device=device)}
        for top_p, draft in itertools.product((1.0, 0.9), (False, True) if drafts else (False,)):
            ops.sample(torch.zeros(rows, vocab, device=device), ones, torch.full((rows,), vocab, dtype=torch.int32,
                       device=device), ones * top_p, ones * 0, torch.zeros(rows, dtype=torch.int64, device=device),
                       filtered=top_p < 1, **(verify if draft else {}))
    logits, one = torch.zeros(1, vocab, device=device), torch.ones(1, device=device)
    for n in (1, 16, 17):
        none = torch.zeros(n, dtype=torch.int32, device=device)
        ops.apply_penalties(logits, none, torch.arange(n, device=device), none, one, one * 0, one * 0)
    ops.apply_token_bitmask(logits, torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32, device=device))


def _multi_branch(logits: torch.Tensor, rows: list[SampleRow], children: list[tuple[int, ...]],
                  q: torch.Tensor) -> torch.Tensor:
    """The draws of rows verifying a tree node's children (engine/spec/multi_branch.py): the target's distribution
    as the sampler's (temperature, then top-k, top-p and min-p), its random numbers from each row's seed."""
    dev, m = logits.device, max(len(c) for c in children)
    p = filtered_probs(logits, *_sampling_tensors(rows, logits.shape[-1], dev)[:4])
    p = p / p.sum(-1, keepdim=True)
    uniforms = upload([[random.Random(r.seed ^ 0x5EED ^ j).random() for j in range(m)] for r in rows],
                      torch.float32, dev)
    generators = [torch.Generator(dev).manual_seed(r.seed) for r in rows]
    return multi_branch_draw(p, q, upload([[*c, *[-1] * (m - len(c))] for c in children], torch.int64, dev),
                             uniforms, generators)


def _restrict(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """allowed_token_ids (everything else masked) and logit_bias (added), as vLLM applies them."""
    dev = logits.device
    allowed = [(i, r.params.allowed_token_ids) for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if allowed:
        keep = torch.ones_like(logits, dtype=torch.bool)
        keep[upload([i for i, _ in allowed], torch.int64, dev)] = False
        keep[upload([i for i, ids in allowed for _ in ids], torch.int64, dev),
             upload([t for _, ids in allowed for t in ids], torch.int64, dev)] = True
        logits.masked_fill_(~keep, float("-inf"))
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()]
    if bias:
        logits.index_put_((upload([i for i, _, _ in bias], torch.int64, dev), upload([t for _, t, _ in bias], torch.int64, dev)),
                          upload([b for _, _, b in bias], torch.float32, dev), accumulate=True)


def _sampling_tensors(rows: list[SampleRow], vocab: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    params = [r.params for r in rows]
    return (
        upload([p.temperature for p in params], torch.float32, dev),
        upload([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int32, dev),
        upload([p.top_p for p in params], torch.float32, dev),
        upload([p.min_p for p in params], torch.float32, dev),
        upload([r.seed for r in rows], torch.int64, dev),
    )


def _penalise(ops, logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Repetition penalty over prompt + output tokens (transformers' rule); presence/frequency over the output."""
    which = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    if not which:
        return
    entry_rows, tokens, counts = [], [], []
    for i in which:
        r = rows[i]
        out = Counter(r.token_ids[len(r.token_ids) - r.num_output:])
        for t in set(r.token_ids):
            entry_rows.append(i)
            tokens.append(t)
            counts.append(out.get(t, 0))
    dev = logits.device
    per_row = lambda f: upload([f(r.params) for r in rows], torch.float32, dev)  # noqa: E731
    ops.apply_penalties(logits, upload(entry_rows, torch.int32, dev), upload(tokens, torch.int64, dev),
                        upload(counts, torch.int32, dev), per_row(lambda p: p.repetition_penalty),
                        per_row(lambda p: p.presence_penalty), per_row(lambda p: p.frequency_penalty))
