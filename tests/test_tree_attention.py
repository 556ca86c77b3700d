"""Tree attention (`flashpage.kernels.tree`): a step's queries of one sequence form a token tree, each seeing the
cached prefix, its ancestors and itself. The Triton kernel (interpreter on CPU) against attention computed node by
node over exactly those keys, random trees over shuffled pages; the model's logits for every node of a tree
against plain forwards of each root-to-node path."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import DEVICE, rel_err
from flashpage.kernels import reference as ref
from flashpage.kernels import triton_ops as tri
from flashpage.kernels.tree import MAX_TREE_TOKENS, ancestors, tree_mask
from flashpage.kv import KVCache, allocate_kv_caches
from flashpage.model.attention import AttentionMetadata
from test_kernels import TOL, cu, nan_like, paged_case, rand


def random_tree(rng: random.Random, max_nodes: int, max_depth: int, max_branch: int) -> list[int]:
    """Parents of a tree grown breadth first from one root: each node below max_depth gets 1..max_branch children
    until max_nodes."""
    parents, depth, frontier = [-1], [0], [0]
    while frontier and len(parents) < max_nodes:
        node = frontier.pop(0)
        if depth[node] == max_depth:
            continue
        for _ in range(rng.randint(1, max_branch)):
            if len(parents) == max_nodes:
                break
            parents.append(node)
            depth.append(depth[node] + 1)
            frontier.append(len(parents) - 1)
    return parents


def node_by_node(q, k_cache, v_cache, table, prefix_lens, trees, scale):
    """Each query attends, in float64, over its sequence's prefix keys and its path's keys, gathered explicitly."""
    page = k_cache.shape[1]
    out, row = [], 0
    for s, (prefix, parents) in enumerate(zip(prefix_lens, trees)):
        slots = [int(table[s, p // page]) * page + p % page for p in range(prefix + len(parents))]
        k = k_cache.flatten(0, 1)[slots].double()
        v = v_cache.flatten(0, 1)[slots].double()
        for i in range(len(parents)):
            keys = list(range(prefix)) + [prefix + j for j in ancestors(parents, i)]
            qi = q[row].double()  # [Hq, D]
            group = qi.shape[0] // k.shape[1]
            kk = k[keys].repeat_interleave(group, 1)  # [n, Hq, D]
            w = torch.softmax(torch.einsum("hd,nhd->hn", qi, kk) * scale, -1)
            out.append(torch.einsum("hn,nhd->hd", w, v[keys].repeat_interleave(group, 1)))
            row += 1
    return torch.stack(out)


CASES = [
    # (prefix lengths, (max nodes, max depth, max branching) per sequence, page, Hq, Hkv, D)
    ([37], [(4, 2, 2)], 16, 8, 2, 64),  # 4 queries x group 4 = 16 rows: the copy-engine decode path
    ([50, 0, 129], [(12, 3, 4), (5, 8, 1), (30, 5, 3)], 16, 8, 2, 64),  # a chain, a prompt that is all tree
    ([20, 300], [(64, 8, 4), (17, 4, 2)], 8, 9, 3, 64),  # the largest tree, pages of 8, SmolLM2's heads
    ([70], [(9, 1, 4)], 16, 4, 4, 80),  # depth 1 (all siblings), head dim 80
    ([33, 10], [(12, 3, 3), "chain 90"], 16, 8, 2, 64),  # beside a 90-token prompt chunk, whose rows take -1
]


@pytest.mark.parametrize("prefix_lens,shapes,page,hq,hkv,dim", CASES)
def test_tree_attention_matches_node_by_node(prefix_lens, shapes, page, hq, hkv, dim):
    rng = random.Random(sum(prefix_lens) + page)
    trees = [list(range(-1, int(s.split()[1]) - 1)) if isinstance(s, str) else random_tree(rng, *s) for s in shapes]
    lens_q = [len(t) for t in trees]
    lens_k = [p + n for p, n in zip(prefix_lens, lens_q)]
    k_cache, v_cache, table, seq_lens, cu_q = paged_case(lens_k, lens_q, page, hkv, dim, torch.bfloat16)
    bits = torch.tensor([b for s, t in zip(shapes, trees) for b in ([-1] * len(t) if isinstance(s, str) else
                                                                      tree_mask(t))], dtype=torch.int64, device=DEVICE)
    q = rand(sum(lens_q), hq, dim, dtype=torch.bfloat16)
    expected = node_by_node(q, k_cache, v_cache, table, prefix_lens, trees, dim**-0.5)
    out = tri.paged_attention(q, KVCache(k_cache, v_cache), table, cu_q, seq_lens, max(lens_q), out=nan_like(q),
                              query_mask=bits)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < TOL[torch.bfloat16]
    reference = ref.paged_attention(q.double(), KVCache(k_cache.double(), v_cache.double()), table, cu_q, seq_lens,
                                    max(lens_q), query_mask=bits)
    assert rel_err(reference, expected) < 1e-12
    if q.device.type == "cpu":  # the CPU set's: the prefix densely, the tree's keys masked, merged
        from flashpage.kernels import cpu
        for dtype, tol in ((torch.bfloat16, TOL[torch.bfloat16]), (torch.float32, 1e-5)):
            got = cpu.paged_attention(q.to(dtype), KVCache(k_cache.to(dtype), v_cache.to(dtype)), table, cu_q,
                                      seq_lens, max(lens_q), out=nan_like(q.to(dtype)), query_mask=bits)
            assert torch.isfinite(got).all() and rel_err(got, expected) < tol, dtype
    if max(lens_q) > 1 and any(len(set(t)) < len(t) for t in trees):  # a real tree is not causal attention
        causal = tri.paged_attention(q, KVCache(k_cache, v_cache), table, cu_q, seq_lens, max(lens_q))
        assert rel_err(causal, expected) > 3 * rel_err(out, expected) + 1e-3


def test_model_logits_for_a_tree_equal_each_paths_own(smollm_llm):
    """SmolLM2 (CPU kernels, float32): a prompt in the cache, then a 14-node tree in one forward with depth
    positions; every node's logits equal those of a plain forward of prompt + its root-to-node path."""
    model = smollm_llm.engine.runner.model
    c = model.config
    rng = random.Random(5)
    prompt = [rng.randrange(c.vocab_size) for _ in range(21)]
    parents = random_tree(rng, 14, 4, 3)
    tokens = [rng.randrange(c.vocab_size) for _ in parents]
    depth = [len(ancestors(parents, i)) - 1 for i in range(len(parents))]
    caches = allocate_kv_caches(c.num_hidden_layers, 4, 16, c.num_key_value_heads, c.head_dim, torch.float32,
                                torch.device("cpu"))
    table = torch.arange(4, dtype=torch.int32)[None, :]
    n, p = len(parents), len(prompt)
    with torch.inference_mode():
        model(torch.tensor(prompt), AttentionMetadata(cu([p]).cpu(), torch.tensor([p], dtype=torch.int32), p,
                                                       torch.arange(p), torch.arange(p), table), caches)
        meta = AttentionMetadata(cu([n]).cpu(), torch.tensor([p + n], dtype=torch.int32), n,
                                 torch.tensor([p + d for d in depth]), torch.arange(p, p + n), table,
                                 query_mask=torch.tensor(tree_mask(parents), dtype=torch.int64))
        logits = model.compute_logits(model(torch.tensor(tokens), meta, caches))
        for i in range(n):
            path = prompt + [tokens[j] for j in ancestors(parents, i)]
            hidden = model(torch.tensor(path), AttentionMetadata.prefill([len(path)]))
            alone = model.compute_logits(hidden[-1:])
            assert rel_err(logits[i:i + 1], alone) < 1e-4, f"node {i} (depth {depth[i]})"


def test_bad_trees_are_named():
    with pytest.raises(ValueError, match="parent 3 is not an earlier node"):
        tree_mask([-1, 0, 3])
    with pytest.raises(ValueError, match=f"at most {MAX_TREE_TOKENS} nodes"):
        tree_mask([-1] + list(range(MAX_TREE_TOKENS)))
    k_cache, v_cache, table, seq_lens, cu_q = paged_case([70], [65], 16, 2, 64, torch.float32)
    q = rand(65, 4, 64, dtype=torch.float32)
    cache = KVCache(k_cache, v_cache)
    for bits, match in [(torch.zeros(65, dtype=torch.int32), "int64"),
                        (torch.zeros(64, dtype=torch.int64), r"\[total_q\] = \[65\]")]:
        for kernels in (tri, ref):
            with pytest.raises(ValueError, match=match):
                kernels.paged_attention(q, cache, table, cu_q, seq_lens, 65, query_mask=bits)
    with pytest.raises(ValueError, match="no sliding window"):
        tri.paged_attention(q[:3], cache, table, cu([3]), seq_lens, 3, query_mask=torch.ones(3, dtype=torch.int64),
                            window_size=(8, 0))
